"""The `pdcluster` command line."""

from __future__ import annotations

import argparse
import sys
import time


def _make_model(args: argparse.Namespace) -> int:
    from engine.builtin_model import write_builtin_model

    path = write_builtin_model(args.out, args.name)
    print(f"wrote builtin:{args.name} to {path}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from pdcluster import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, ignore_eos=args.ignore_eos)
    start = time.perf_counter()
    outs = llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1)
    elapsed = time.perf_counter() - start
    for out in outs:
        print(f"--- {out.prompt!r} -> {len(out.token_ids)} tokens, finish_reason={out.finish_reason}")
        print(out.text)
    n = sum(len(o.token_ids) for o in outs)
    print(f"--- {len(outs)} requests, {n} tokens in {elapsed:.2f}s ({n / elapsed:.1f} tok/s), "
          f"prefill -> in-process KV transfer -> decode", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description="Prefill-Decode disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    mm = sub.add_parser("make-model", help="write the built-in random Llama checkpoint (HF format)")
    mm.add_argument("--out", required=True, help="output directory")
    mm.add_argument("--name", default="tiny-llama", help="built-in model name (default: tiny-llama)")
    mm.set_defaults(func=_make_model)

    gen = sub.add_parser("generate", help="offline generation (prefill and decode engines in one process)")
    gen.add_argument("prompts", nargs="+", help="prompt texts")
    gen.add_argument("--model", default="builtin:tiny-llama", help="builtin:NAME or a local HF checkpoint dir")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # bad input: one clear line, no traceback
        print(f"pdcluster: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
