"""One long document, several questions on it: an SGLang frontend program against sglang-shadowkv.

The document goes into the server once: `cache_prefix` sends it alone (max_new_tokens 0), the
server prefills it and, with --attention shadowkv, compresses it into the radix cache. (A fork
sends its prefix the same way, but only if the frontend's worker thread has already appended it;
asking for it explicitly makes sure the branches, which run concurrently, find it cached.) Every
branch then starts from that compressed document: `select` scores its choices (prompt logprobs)
and `gen(regex=...)` decodes under a grammar, each reading the document sparsely.

    python -m sglang_shadowkv.launch_server --attention shadowkv --shadowkv-min-context 512 --port 30000
    python examples/frontend_shared_document.py --url http://127.0.0.1:30000

It prints each branch's answers, then the server's ShadowKV counters as one JSON line: the
document was compressed once (compressions) and every branch reused it (compressed_prefix_hits).
"""

import argparse
import json

import requests
import sglang as sgl

PLACES = ["mill", "bridge", "library", "chapel", "market hall", "school", "harbour wall", "lighthouse",
          "town hall", "granary", "bathhouse", "observatory"]
QUESTIONS = ["When was the mill built?", "When was the lighthouse built?"]


def town_archive() -> str:
    """A long made-up document: the building years and keepers of a river town, told at length."""
    lines = []
    for i, place in enumerate(PLACES):
        year = 1790 + 13 * i
        lines.append(f"The {place} was built in {year}. Its first keeper was a carpenter named "
                     f"Keeper {chr(65 + i)}, who kept a ledger of every repair, every storm and every "
                     f"visitor. The town council met in the {place} once a year to read that ledger "
                     f"aloud, and the records of those meetings are kept in the stone archive.")
    return "Archive of the river town.\n\n" + "\n\n".join(lines) + "\n\n"


@sgl.function
def ask_archive(s, document, questions):
    s += document
    branches = s.fork(len(questions))
    for branch, question in zip(branches, questions):
        branch += f"Question: {question}\nIs it in the archive? "
        branch += sgl.select("found", choices=["yes", "no"])
        branch += "\nYear: " + sgl.gen("year", regex=r"1[0-9]{3}", max_tokens=8)
    s["answers"] = [{"question": q, "found": b["found"], "year": b["year"]}
                    for q, b in zip(questions, branches)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url)
    sgl.set_default_backend(backend)
    document = town_archive()
    backend.cache_prefix(document)
    state = ask_archive.run(document=document, questions=QUESTIONS)
    for answer in state["answers"]:
        print(f"{answer['question']} in the archive: {answer['found']}; year: {answer['year']}")
    shadowkv = requests.get(args.url + "/get_server_info", timeout=30).json()["shadowkv"] or {}
    print(json.dumps({"answers": state["answers"],
                      "shadowkv": {k: shadowkv.get(k) for k in ("compressions", "compressed_tokens",
                                                                 "compressed_prefix_hits")}}))


if __name__ == "__main__":
    main()
