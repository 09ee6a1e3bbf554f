#!/usr/bin/env python3
"""kvrelay demo (the README's main command): agent A hands its context to agent B.

Three reference workers with the same synthetic Llama (big enough that prefill matters on a CPU),
two kvrelay sidecars peered over TCP. For each context length B answers A's prompt + A's answer +
a follow-up, with the KV medium forced to each choice in turn and then left to kvrelay's decision
engine, and once more on A's own node (KV over shared memory), next to the floor: B's request
repeated once B's own worker holds the whole context (local hit). The table shows B's time to first
token for each; the verdict says what kvrelay is for. Usage: demo.py [BUILD_DIR] [--lengths ...]
"""
import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import handoff  # noqa: E402

COLUMNS = ["tokens", "kv_raw", "kv_lossless", "kv_fp8", "kv_int8", "kv_int4"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", nargs="?", default="build/default")
    parser.add_argument("--lengths", default="64,256,512,1024,2048")
    parser.add_argument("--shape", default=handoff.DEMO_SHAPE)
    args = parser.parse_args()
    lengths = [int(value) for value in args.lengths.split(",")]

    with handoff.Cluster(args.build, args.shape) as cluster:
        handoff.warm_up(cluster, max(lengths))
        print(f"\nmodel: synthetic Llama {args.shape} (fp32, CPU), same weights on every worker")
        print("node-a: agent A and agent B-local behind one sidecar; node-b: agent B behind its own sidecar;")
        print("sidecars peer over TCP with mutual TLS (development certificates). B gets A's prompt + A's 16-token answer + an 8-token follow-up.")
        # Media are forced through the admin API, which answers only on each sidecar's admin listener.
        if not all(cluster.admin_only_on_admin_listener(node) for node in ("node-a", "node-b")):
            sys.exit("demo failed: the admin API must answer on listen.admin only, and 404 on the agent listener")
        print("admin API (forcing media, flushing KV): on each sidecar's admin listener (listen.admin) only;")
        print("its agent listener answers 404 there, and a policy without listen.admin has no admin API.")
        if not all(cluster.admin_changes_need_token(node) for node in ("node-a", "node-b")):
            sys.exit("demo failed: an admin change without the admin token must be refused (401)")
        print("changes there need the admin token (admin.token_file; generated for this run): without it, 401.")
        print(f"(after one {max(lengths)}-token handoff over TCP and one over shared memory, which warm the sidecars' kept buffers and arena)\n")
        print("B's time to first token (ms), by how A's context reaches B:")
        header = (f"{'context':>7} | " + " ".join(f"{name:>11}" for name in COLUMNS) +
                  f" | {'engine chose':>12} {'engine':>8} {'vs best':>8} | {'kv_raw shm':>10} | {'local hit':>9}"
                  f" | same answer")
        print(header)
        print("-" * len(header))
        rows = []
        for index, length in enumerate(lengths):
            row = handoff.run_length(cluster, length, seed=index)
            runs = row["runs"]
            best = min(runs[name]["ttft_ms"] for name in COLUMNS)
            engine = runs["engine"]
            exact = all(runs[name]["token_ids"] == runs["tokens"]["token_ids"]
                        for name in ("kv_raw", "kv_lossless", "kv_raw_shm", "local_hit"))
            rows.append((row, best, exact))
            print(f"{length:>7} | " + " ".join(f"{runs[name]['ttft_ms']:>11.1f}" for name in COLUMNS) +
                  f" | {engine['medium']:>12} {engine['ttft_ms']:>8.1f} {engine['ttft_ms'] / best - 1:>+7.0%} |"
                  f" {runs['kv_raw_shm']['ttft_ms']:>10.1f} | {runs['local_hit']['ttft_ms']:>9.1f} |"
                  f" {'yes' if exact else 'NO'}"
                  f" (int8 {runs['kv_int8']['top1_agreement']:.0%}, int4 {runs['kv_int4']['top1_agreement']:.0%})")

        last, _, _ = rows[-1]
        tokens_ms = last["runs"]["tokens"]["ttft_ms"]
        shm_ms = last["runs"]["kv_raw_shm"]["ttft_ms"]
        tcp_ms = last["runs"]["kv_raw"]["ttft_ms"]
        local_ms = last["runs"]["local_hit"]["ttft_ms"]
        worst_regret = max(row["runs"]["engine"]["ttft_ms"] / best - 1 for row, best, _ in rows)
        all_exact = all(exact for _, _, exact in rows)
        print(f"\nverdict: at {last['length']} tokens B's first token took {tokens_ms / 1000:.2f} s when it re-read "
              f"A's context as tokens, {tcp_ms / 1000:.2f} s with A's KV from the other node over TCP "
              f"({tokens_ms / tcp_ms:.1f}x) and {shm_ms / 1000:.2f} s from shared memory on A's node "
              f"({tokens_ms / shm_ms:.1f}x); the floor, B's own worker already holding the whole context "
              f"(local hit), is {local_ms / 1000:.2f} s. Lossless media gave "
              f"{'identical answers at every length' if all_exact else 'DIFFERENT answers'}; lossy ones show their "
              f"top-1 agreement. Left to itself, kvrelay's engine was at most {worst_regret:+.0%} from the best "
              f"medium measured at each length.")
        if not all_exact:
            sys.exit("demo failed: a lossless KV medium changed B's answer")
    print("sidecars drained and exited")


if __name__ == "__main__":
    main()
