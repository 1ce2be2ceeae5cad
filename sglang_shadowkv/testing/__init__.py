"""Helpers shared by the tests and the benchmarks: live servers, prompts, corpora, benchmark flags."""
