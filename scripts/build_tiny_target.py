"""Build (or reuse) the embedded default target and draft LM; print where they are and how good.

    python scripts/build_tiny_target.py            # reuse the cache when valid (seconds)
    python scripts/build_tiny_target.py --force    # rebuild (~7 min on 2 CPU cores)
"""

import argparse
import logging
from pathlib import Path

from train.tiny.corpus import default_draft_dir
from train.tiny.build import ensure_tiny_target, load_meta


def _summary(kind: str, path: Path) -> dict:
    meta = load_meta(path)
    t = meta["training"]
    print(f"{kind}: {path}\n  held-out loss {meta['heldout_loss']:.4f} nats/token "
          f"({meta['heldout_bits_per_byte']:.3f} bits/byte) | "
          f"{meta['model']['num_parameters']:,} parameters | {t['steps']} steps x "
          f"{t['batch_size']} x {t['seq_len']} = {meta['tokens_seen']:,} tokens | "
          f"built in {meta['build_seconds']:.0f} s" + (" (time cap hit)" if t["stopped_early"]
                                                       else ""))
    return meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if the cache is valid")
    parser.add_argument("--out", type=Path, help="target directory (default <cache>/tiny-target)")
    parser.add_argument("--draft-out", type=Path, help="draft dir (default <cache>/tiny-draft)")
    parser.add_argument("--no-draft", action="store_true", help="the target only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch threads (default: half the cores)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    target = ensure_tiny_target(args.out, with_draft=not args.no_draft, draft_dir=args.draft_out,
                                force=args.force, num_threads=args.threads, seed=args.seed)
    meta = _summary("target", target)
    if not args.no_draft:
        _summary("draft", args.draft_out or default_draft_dir())
    for key, title in (("sample", "raw code"), ("chat_sample", "chat template")):
        print(f"===== target, greedy continuation of a held-out snippet ({title}) =====")
        print(f"--- prompt ---\n{meta[key]['prompt']}\n--- completion ---\n"
              f"{meta[key]['completion']}")


if __name__ == "__main__":
    main()
