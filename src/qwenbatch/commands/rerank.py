"""``qwenbatch rerank``: documents of a file ranked against a query by a Qwen3-Reranker."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from qwenbatch.commands.engine_args import add_engine_args, engine_config_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register this sub-command on the top-level parser."""
    rr = sub.add_parser(
        "rerank",
        help="rank the documents of a file against a query (Qwen3-Reranker)",
        description="Score each line of --documents against --query and print them best first: "
        "score, index (among the file's non-blank lines, from 0), document.",
    )
    rr.add_argument("--query", required=True)
    rr.add_argument("--documents", type=Path, required=True, help="a text file, one document per line")
    rr.add_argument("--instruction", help="the reranker's task instruction (default: web search)")
    rr.add_argument("--top-n", type=int, help="print only the best N")
    rr.add_argument("--json", action="store_true", help="one JSON object a line: index, score, document")
    add_engine_args(rr)
    rr.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the sub-command; returns the exit code (errors raise ValueError for a one-line message)."""
    from qwenbatch.llm import LLM

    if not args.documents.is_file():
        raise FileNotFoundError(f"{args.documents}: no such file")
    documents = [line for line in args.documents.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    if not documents:
        raise ValueError(f"{args.documents}: no documents (one per line)")
    if not args.query.strip():
        raise ValueError("--query must not be empty")
    if args.top_n is not None and args.top_n < 1:
        raise ValueError("--top-n must be >= 1")
    config = engine_config_from_args(args)
    if config.task == "auto":
        config.task = "rerank"  # this command only scores
    llm = LLM(**vars(config))
    for r in llm.rerank(args.query, documents, args.instruction, args.top_n):
        if args.json:
            print(json.dumps({"index": r.index, "score": r.score, "document": r.document}, ensure_ascii=False))
        else:
            print(f"{r.score:.6f}\t{r.index}\t{r.document}")
    return 0
