"""vLLM with aio_datadist's connector: per-request KV transfer time and TTFT, disaggregated against one instance.

In one run, on loopback, with the example's tiny random Llama (4 layers,
2 KV heads of 64, bf16: 2 KiB of KV per token) and prompts of several
lengths sent one at a time (no batching effects):

- one vLLM alone: TTFT (request added -> first token);
- prefill + decode vLLM with ``AioDatadistConnector``: TTFT seen by the proxy
  (prompt sent to the prefill -> first token from the decode), the decode's
  own time to first token (it includes the pull), and the pull itself (from
  the connector's ``stats_path`` lines);
- the same with vLLM's own ``NixlConnector`` on host memory, if it starts
  here; if not, the reason is printed.

Run: ``python benchmarks/vllm_connector.py [--rounds 3]`` in the vLLM
environment (``tools/check_vllm.sh`` runs it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import traceback
from pathlib import Path

# benchmarks/nixl.py would shadow the `nixl` package NixlConnector imports (vLLM then says "NIXL is not
# available"): this directory leaves the path, here and in the engines' processes, which inherit it
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != HERE]
sys.path.insert(0, str(HERE.parent / "examples"))

import vllm_disaggregated as vd  # noqa: E402 - after the path is set

LENGTHS = (256, 1024, 1792)


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:8.1f}"


def _one_by_one(run, batch: dict[str, list[int]]) -> dict[str, dict]:
    out = {}
    for req, prompt in batch.items():
        out.update(run({req: prompt}))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="requests per prompt length (median reported)")
    parser.add_argument("--max-tokens", type=int, default=4)
    args = parser.parse_args(argv)
    rows: dict[str, dict[int, dict[str, list[float]]]] = {}
    notes: list[str] = []
    os.environ.setdefault(vd.SECRET_ENV, vd.secrets.token_hex(16))  # authenticated, as a deployment should be
    with tempfile.TemporaryDirectory(prefix="vllm_bench_") as work:
        model = vd.make_model(os.path.join(work, "model"))
        batches = {n: {f"n{n}-r{r}": vd.prompts(1, seed=100 * n + r, lengths=(n, n + 1))[0]
                       for r in range(args.rounds + 1)} for n in LENGTHS}  # the first of each is a warm-up
        reference: dict[str, list[int]] = {}

        single = vd.Node("single", model)
        try:
            for n, batch in batches.items():
                out = _one_by_one(lambda b: vd.alone(single, b, args.max_tokens), batch)
                reference.update({r: o["tokens"] for r, o in out.items()})
                rows.setdefault("one instance", {})[n] = {
                    "ttft": [o["first_token"] - o["started"] for r, o in out.items() if not r.endswith("r0")]}
        finally:
            single.close()

        def disaggregated(name: str, prefill_cfg: dict, decode_cfg: dict, stats: str | None,
                          env: tuple[dict[str, str], dict[str, str]] = ({}, {})) -> None:
            nodes = []
            try:
                nodes.append(vd.Node(f"{name}-prefill", model, prefill_cfg, env[0]))
                nodes.append(vd.Node(f"{name}-decode", model, decode_cfg, env[1]))
                for n, batch in batches.items():
                    out = _one_by_one(lambda b: vd.disaggregate(nodes[0], nodes[1], b, args.max_tokens), batch)
                    wrong = [r for r, o in out.items() if o["tokens"] != reference[r]]
                    if wrong:
                        notes.append(f"{name}: tokens differ from one instance for {wrong}")
                    keep = [r for r in out if not r.endswith("r0")]
                    cell = rows.setdefault(name, {})[n] = {
                        "ttft": [out[r]["first_token"] - out[r]["sent"] for r in keep],
                        "decode_ttft": [out[r]["first_token"] - out[r]["started"] for r in keep]}
                    if stats:
                        pulls = {e["req"]: e for e in vd.read_stats(stats) if e["event"] == "pull"}
                        cell["pull"] = [pulls[r]["seconds"] for r in keep if r in pulls]
                        cell["mib"] = [pulls[r]["bytes"] / 2**20 for r in keep if r in pulls]
            finally:
                for node in nodes:
                    node.close()

        stats = os.path.join(work, "stats.jsonl")
        disaggregated("aio_datadist", vd.connector_config("kv_producer", {"stats_path": stats}),
                      vd.connector_config("kv_consumer", {"stats_path": stats}), stats)
        try:
            nixl = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}
            disaggregated("NixlConnector", {**nixl, "kv_role": "kv_producer"}, {**nixl, "kv_role": "kv_consumer"},
                          None, ({"VLLM_NIXL_SIDE_CHANNEL_PORT": "5611"}, {"VLLM_NIXL_SIDE_CHANNEL_PORT": "5621"}))
        except Exception as exc:
            traceback.print_exc()
            notes.append(f"NixlConnector did not run: {type(exc).__name__}: {str(exc)[:300]}")
            rows.pop("NixlConnector", None)

    print(f"\nvLLM connector figures (median of {args.rounds} requests per prompt length, one at a time; "
          f"ms):", flush=True)
    print(f"{'setup':<15}{'prompt':>7}{'KV MiB':>8}{'TTFT':>9}{'decode TTFT':>12}{'pull':>9}")
    for name, by_len in rows.items():
        for n, cell in by_len.items():
            mib = f"{statistics.median(cell['mib']):8.2f}" if cell.get("mib") else f"{'':>8}"
            decode = _ms(cell["decode_ttft"]) if "decode_ttft" in cell else f"{'-':>8}"
            pull = _ms(cell["pull"]) if cell.get("pull") else f"{'-':>8}"
            print(f"{name:<15}{n:>7}{mib}{_ms(cell['ttft']):>9}{decode:>12}{pull:>9}")
    for note in notes:
        print(f"note: {note}")
    failed = [n for n in notes if "tokens differ" in n]
    print(f"{'FAILED' if failed else 'OK'}: vllm_connector benchmark: {len(rows)} setups measured", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
