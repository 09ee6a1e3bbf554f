#!/usr/bin/env python3
"""Paired no-regression benchmark: the demo's handoff (scripts/handoff.py) on two builds' binaries
(kvrelay and kvrelay-refworker of OLD_BUILD_DIR and NEW_BUILD_DIR) in one run, alternating between
them, and B's time to first token per medium for each build with the ratio new/old.
Prints one JSON object. Usage: paired_binaries.py OLD_BUILD_DIR NEW_BUILD_DIR [--rounds N]
[--lengths 2048,512] [--tolerance 0.10]

Both clusters (three workers and two sidecars each) run side by side and take turns: in each
round and length A answers on both, then every medium (and the engine's run, B-local's
kv_raw_shm and the local hit) runs on both builds back to back, in a shuffled order shared by
both, the build that goes first alternating. Each build is warmed as e2e_bench warms one (a
discarded kv_raw handoff at the longest length, a discarded round at the shortest).
A medium's `ratio` is the median over rounds of new/old within the round (paired), with a 90%
bootstrap interval over rounds, next to the ratio of the two builds' medians; `geomean_ratio`
is the geometric mean of the gated media's ratios at one length. `pass` holds when at every
length the geomean is at most 1 + tolerance and no gated medium's interval lies wholly above it
(a medium alone is too noisy on a shared host to gate on its median; the strict reading is
`every_medium_within_tolerance`). The engine's own run is reported but not gated: its choice
differs from run to run even on the same binaries. Running a build against itself (the same
directory twice) shows the noise floor of the ratios.
"""
import argparse
import datetime
import hashlib
import json
import math
import pathlib
import random
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "scripts"))
import handoff  # noqa: E402
import e2e_bench  # noqa: E402

BINARIES = {"kvrelay": ("proxy", "kvrelay"), "kvrelay-refworker": ("refworker", "kvrelay-refworker")}
UNGATED = {"engine"}


def describe(build):
    build = pathlib.Path(build).resolve()
    binaries = {}
    for name, parts in BINARIES.items():
        path = build.joinpath(*parts)
        if not path.is_file():
            sys.exit(f"{path} not found: build {name} into {build} first")
        binaries[name] = {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {"build": str(build), "binaries": binaries}


def geomean_of_medians(rounds):
    """The geometric mean over labels of each label's median ratio; `rounds` holds one tuple of
    ratios (one per label) per round."""
    columns = list(zip(*rounds))
    return math.exp(statistics.mean(math.log(statistics.median(column)) for column in columns))


def bootstrap(values, statistic, rng, iterations=2000):
    """90% bootstrap interval of `statistic` over `values` (the rounds) resampled with replacement."""
    estimates = sorted(statistic(rng.choices(values, k=len(values))) for _ in range(iterations))
    return [estimates[int(0.05 * iterations)], estimates[int(0.95 * iterations) - 1]]


def median_or_none(values):
    return statistics.median(values) if values else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="build directory of the reference binaries")
    parser.add_argument("new", help="build directory of the binaries under test")
    parser.add_argument("--rounds", type=int, default=5, help="runs per build and length (paired medians)")
    parser.add_argument("--lengths", default="2048,512")
    parser.add_argument("--tolerance", type=float, default=0.10, help="largest slowdown new/old - 1 that passes")
    parser.add_argument("--seed", type=int, default=1, help="seeds the order of the media")
    parser.add_argument("--shape", default=handoff.DEMO_SHAPE)
    parser.add_argument("--new-memory-strategy", default=None, choices=["portable", "prefault"],
                        help="limits.memory_strategy for the new build's sidecars (default: its own default)")
    args = parser.parse_args()
    lengths = [int(value) for value in args.lengths.split(",")]
    builds = {"old": describe(args.old), "new": describe(args.new)}

    result = {"bench": "e2e_paired", "date": datetime.datetime.utcnow().strftime("%Y-%m-%dT%H:%MZ"),
              "machine": e2e_bench.machine(), "shape": args.shape, "rounds": args.rounds,
              "tolerance": args.tolerance, "old": builds["old"], "new": builds["new"],
              "new_memory_strategy": args.new_memory_strategy or "default",
              "same_binaries": all(builds["old"]["binaries"][name]["sha256"] ==
                                   builds["new"]["binaries"][name]["sha256"] for name in BINARIES),
              "lengths": []}
    samples = {(side, length): [] for side in builds for length in lengths}
    with handoff.Cluster(builds["old"]["build"], args.shape) as old, \
            handoff.Cluster(builds["new"]["build"], args.shape, args.new_memory_strategy) as new:
        clusters = {"old": old, "new": new}
        for cluster in clusters.values():
            handoff.warm_up(cluster, max(lengths))
            handoff.run_length(cluster, min(lengths), 10_000, random.Random(args.seed))  # discarded
        for round_index in range(args.rounds):
            for length_index, length in enumerate(lengths):
                # Same prompt and same order of media on both builds.
                seed = round_index * len(lengths) + length_index
                runs = {side: handoff.LengthRun(clusters[side], length, seed) for side in builds}
                order = runs["old"].order(random.Random(args.seed * 1_000_003 + seed))
                for label_index, label in enumerate(order):
                    # Each label on both builds back to back, which goes first alternating.
                    first = "old" if (round_index + label_index) % 2 == 0 else "new"
                    for side in (first, "new" if first == "old" else "old"):
                        runs[side].run(label)
                for side in builds:
                    samples[side, length].append(runs[side].result())
            print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)

    rng = random.Random(args.seed)
    limit = 1 + args.tolerance
    failures = []
    for length in lengths:
        labels = [label for label in e2e_bench.LABELS if label in samples["old", length][0]["runs"]]
        paired = {}
        media = {}
        for label in labels:
            runs = {side: [s["runs"][label]["ttft_ms"] for s in samples[side, length]] for side in builds}
            paired[label] = [n / o for o, n in zip(runs["old"], runs["new"])]
            entry = {
                "old_ttft_ms": statistics.median(runs["old"]),
                "new_ttft_ms": statistics.median(runs["new"]),
                "ratio": statistics.median(paired[label]),
                "ratio_90ci": bootstrap(paired[label], statistics.median, rng),
                "ratio_of_medians": statistics.median(runs["new"]) / statistics.median(runs["old"]),
                "old_relative_iqr": e2e_bench.spread(runs["old"]),
                "new_relative_iqr": e2e_bench.spread(runs["new"]),
                "gated": label not in UNGATED,
                "old_ttft_ms_runs": runs["old"],
                "new_ttft_ms_runs": runs["new"],
            }
            entry["within_tolerance"] = entry["ratio"] <= limit
            if entry["gated"] and entry["ratio_90ci"][0] > limit:
                failures.append({"length": length, "medium": label, "ratio": entry["ratio"],
                                 "ratio_90ci": entry["ratio_90ci"]})
            media[label] = entry
        gated_labels = [label for label in labels if label not in UNGATED]
        rounds = list(zip(*(paired[label] for label in gated_labels)))  # per round, one ratio per label
        geomean = geomean_of_medians(rounds)
        geomean_ci = bootstrap(rounds, geomean_of_medians, rng)
        if geomean > limit:
            failures.append({"length": length, "medium": "geomean", "ratio": geomean, "ratio_90ci": geomean_ci})
        result["lengths"].append({
            "length": length,
            "geomean_ratio": geomean,
            "geomean_ratio_90ci": geomean_ci,
            "media": media,
            "engine_choices": {side: [s["runs"]["engine"]["medium"] for s in samples[side, length]] for side in builds},
            "top1_agreement": {side: {label: statistics.mean(s["runs"][label]["top1_agreement"]
                                                             for s in samples[side, length]) for label in labels}
                               for side in builds},
            "local_hit_ratio_to_tokens": {
                side: median_or_none([s["runs"]["local_hit"]["ttft_ms"] / s["runs"]["tokens"]["ttft_ms"]
                                      for s in samples[side, length]]) for side in builds},
        })
    gated = [(entry["length"], label, media["ratio"]) for entry in result["lengths"]
             for label, media in entry["media"].items() if media["gated"]]
    worst = max(gated, key=lambda item: item[2])
    result["worst_ratio"] = {"length": worst[0], "medium": worst[1], "ratio": worst[2]}
    result["failures"] = failures
    result["pass"] = not failures
    result["every_medium_within_tolerance"] = all(media["within_tolerance"] for entry in result["lengths"]
                                                  for media in entry["media"].values() if media["gated"])
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
