"""Offline English text for long prompts: the docstrings of Python's standard library.

Real prose (not random tokens), the same on every machine with the same Python, no download.
"""

from __future__ import annotations

import importlib
import inspect
import random

MODULES = ["abc", "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib",
           "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions",
           "functools", "gettext", "glob", "heapq", "html", "http", "imaplib", "inspect", "io",
           "ipaddress", "itertools", "json", "logging", "mailbox", "numbers", "operator", "optparse",
           "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "sched", "secrets",
           "selectors", "shelve", "shutil", "smtplib", "socket", "sqlite3", "statistics", "string",
           "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
           "tokenize", "traceback", "typing", "unittest", "urllib", "uuid", "warnings", "weakref",
           "xml", "zipfile", "zoneinfo"]


def paragraphs() -> list[str]:
    """Every docstring paragraph of at least 200 characters from the modules above, in order."""
    seen, out = set(), []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        objs = [mod] + [obj for _, obj in inspect.getmembers(mod)
                        if inspect.isclass(obj) or inspect.isfunction(obj)]
        for obj in objs:
            doc = inspect.getdoc(obj) or ""
            for para in doc.split("\n\n"):
                para = " ".join(para.split())
                if len(para) >= 200 and para not in seen:
                    seen.add(para)
                    out.append(para)
    return out


def document(tokenizer, num_tokens: int, seed: int) -> list[int]:
    """About num_tokens tokens of consecutive paragraphs starting at a seeded random place."""
    paras = paragraphs()
    rng = random.Random(seed)
    start = rng.randrange(len(paras))
    ids: list[int] = []
    i = start
    while len(ids) < num_tokens:
        ids += tokenizer.encode(paras[i % len(paras)] + "\n\n", add_special_tokens=False)
        i += 1
    return ids[:num_tokens]


__all__ = ["paragraphs", "document"]
