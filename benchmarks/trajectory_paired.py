"""Paired per-seed differences of the trajectory methods from a harness ``results.json`` (markdown to stdout).

Run: ``python benchmarks/trajectory_paired.py results/trajectory/results.json > results/trajectory/paired.md``.
"""

import json
import statistics
import sys

PAIRS = [
    ("bsam", "map"), ("bsam", "sam_torch"), ("sam_torch", "map"), ("hwa", "vi_cyclical"), ("hwa", "vi"),
    ("hwa_total", "hwa"), ("vi_cyclical", "vi"), ("f_swag", "swag"), ("f_swa", "swa"), ("swag", "map"),
    ("swa", "map"),
]
METRICS = ["acc", "nll", "ece", "lambda_max"]


def main(path: str) -> None:
    payload = json.load(open(path))
    metrics = {(r["dataset"], r["method"], r["seed"]): r["metrics"] for r in payload["records"]}
    seeds = sorted({r["seed"] for r in payload["records"]})
    lines = [
        "# Paired differences over seeds",
        "",
        f"Command: `python benchmarks/trajectory_paired.py {path}`",
        "",
        f"Seeds {seeds} for both methods of a pair (`hwa`, `hwa_total` and `vi_cyclical` share one trajectory per "
        "seed). Mean ± std of the per-seed difference A − B, and in how many seeds A − B > 0. Accuracy in points.",
        "",
    ]
    for dataset in dict.fromkeys(r["dataset"] for r in payload["records"]):
        lines += [f"**{dataset}**", "", "| A − B | " + " | ".join(METRICS) + " |", "|---" * (len(METRICS) + 1) + "|"]
        for a, b in PAIRS:
            if (dataset, a, seeds[0]) not in metrics or (dataset, b, seeds[0]) not in metrics:
                continue
            cells = []
            for key in METRICS:
                scale = 100 if key == "acc" else 1
                diff = [(metrics[(dataset, a, s)][key] - metrics[(dataset, b, s)][key]) * scale for s in seeds]
                spread = statistics.stdev(diff) if len(diff) > 1 else float("nan")
                cells.append(f"{statistics.mean(diff):+.4f} ± {spread:.4f} ({sum(d > 0 for d in diff)}/{len(diff)})")
            lines.append(f"| {a} − {b} | " + " | ".join(cells) + " |")
        lines.append("")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
