"""A stand-in for `setdiff sample` with its sharding interface, to test array jobs without a model.

python slurm_shard_worker.py --prompts P.jsonl --out O.jsonl --shard I --num-shards N
    writes the results of prompts I, I+N, I+2N, ... to O.jsonl.part-I-of-N
python slurm_shard_worker.py --prompts P.jsonl --out O.jsonl
    merges the part files, computes what they lack, and writes O.jsonl in prompt order
"""

import json
from pathlib import Path

from setdiff_megatron.errors import ArgumentParser


def result(index: int, prompt: str) -> dict:
    return {"index": index, "prompt": prompt, "completion": prompt[::-1].upper()}


def main() -> None:
    parser = ArgumentParser()
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shard", type=int)
    parser.add_argument("--num-shards", type=int)
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines()]
    out = Path(args.out)
    if args.shard is not None:
        part = out.with_name(f"{out.name}.part-{args.shard}-of-{args.num_shards}")
        rows = [result(i, p) for i, p in enumerate(prompts) if i % args.num_shards == args.shard]
        part.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return
    done = {}
    for part in sorted(out.parent.glob(f"{out.name}.part-*")):
        for line in part.read_text().splitlines():
            row = json.loads(line)
            done[row["index"]] = row
    rows = [done.get(i) or result(i, p) for i, p in enumerate(prompts)]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
