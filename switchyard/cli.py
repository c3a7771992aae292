"""The `switchyard` console script: one entry point, subcommands dispatch to each component's `main(argv)`."""

from __future__ import annotations

import importlib
import os
import sys

USAGE = """usage: switchyard <command> [args]

commands:
  serve              run the router daemon
  worker sim         run a simulated vLLM-like worker
  worker vllm        run vLLM (AsyncLLM, in-process) behind the Worker service; from .venv-vllm (make vllm-env)
  keys new | check   make an API key's line; check a keys file as the router reads it
  demo               the main job: router + 4 simulated workers + a Mooncake slice, printing a results table
  bench sim          discrete-event simulation of N workers in virtual time
  bench live         router + simulated worker processes over loopback gRPC: router-added latency
  bench relay        a bare gRPC relay with no routing logic (bench live's floor of a Python gRPC router)
  bench soak         router + simulated workers under sustained load: memory (RSS) and CPU over time
  bench profiles     fit error of each performance profile against the measured tables
  bench radix        micro-benchmark of the global prefix radix tree (match, insert; Cython vs Python)
  bench decisions    routing decisions/s and select latency of each policy alone, vs Preble's 634/245/2931
  bench snapshot     a fresh KV-event subscription: a worker's whole cache, the router's event-loop stall per policy
  bench suite        the simulator campaign: Preble workloads x policies x 2 loads, ablation, no-sharing, scaling
  bench e2-select    micro-benchmark of E2's per-select loops (exploit set, bounds; Cython vs Python, same calls)
  bench anticipator  micro-benchmark of the per-worker load anticipator (add, finish, peak query; Cython vs Python)
  bench predictor    output-length predictor latency: teacher/student, fp32/int8, batch 1 and batched, 1 thread
  bench routing      PreServe RQ3: ShareGPT Poisson load on 4 simulated workers, policies x predictors
  predictor train    train the output-length predictor on ShareGPT (teacher, then the distilled student)
  predictor export   export a trained predictor to ONNX (fp32 and int8)
  predictor eval     accuracy on the held-out 30% split vs mean / prompt-length / bucket-classifier baselines

Run `switchyard <command> --help` for a command's options.
"""

COMMANDS: dict[tuple[str, ...], str] = {
    ("serve",): "switchyard.router.server",
    ("worker", "sim"): "switchyard.workers.sim_worker",
    ("worker", "vllm"): "switchyard.workers.vllm_worker",
    ("keys",): "switchyard.keys_cli",
    ("demo",): "switchyard.bench.demo",
    ("bench", "sim"): "switchyard.bench.sim",
    ("bench", "live"): "switchyard.bench.live",
    ("bench", "relay"): "switchyard.bench.relay",
    ("bench", "soak"): "switchyard.bench.soak",
    ("bench", "profiles"): "switchyard.bench.profiles",
    ("bench", "radix"): "switchyard.bench.micro.radix",
    ("bench", "decisions"): "switchyard.bench.micro.decisions",
    ("bench", "snapshot"): "switchyard.bench.micro.snapshot",
    ("bench", "suite"): "switchyard.bench.suite",
    ("bench", "e2-select"): "switchyard.bench.micro.e2_select",
    ("bench", "anticipator"): "switchyard.bench.micro.anticipator",
    ("bench", "predictor"): "switchyard.bench.predictor_latency",
    ("bench", "routing"): "switchyard.bench.routing",
    ("predictor", "train"): "switchyard.router.predictor.train",
    ("predictor", "export"): "switchyard.router.predictor.export",
    ("predictor", "eval"): "switchyard.router.predictor.evaluate",
}


# gRPC's own I/O for channels and listeners (its "legacy" iomgr, polled by grpc.aio's completion-queue thread)
# instead of the EventEngine's thread pool, whose extra thread hop per completion cost ~15% of a router's CPU per
# request on loopback (README, "gRPC's I/O threads"). Read once, when grpc is first imported, so it is set here,
# before any command imports it; an operator's own GRPC_EXPERIMENTS (an empty one: gRPC's defaults) wins.
GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)
    args = list(sys.argv[1:] if argv is None else argv)
    for words, module in COMMANDS.items():
        if tuple(args[: len(words)]) == words:
            entry = importlib.import_module(module).main
            return int(entry(args[len(words) :]) or 0)
    print(USAGE, file=sys.stderr if args and args[0] not in ("-h", "--help") else sys.stdout)
    return 0 if args and args[0] in ("-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main())
