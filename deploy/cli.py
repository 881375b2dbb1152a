"""The `pdserve` command line.

  pdserve generate PROMPT --local [-c CONFIG] [--model M] ...   run the engine in this process
  pdserve generate PROMPT --router HOST:PORT ...     send the request through a running router
  pdserve model fetch [MODEL]                        resolve/convert a model once (demo: smollm2-135m)
  pdserve bench engine|kvtransfer|peers|serve|trace [...]  benchmarks (see bench/, docs/benchmarks.md, docs/trace_replay.md)
  pdserve serve [-c CONFIG] [--address RAY]          router + pools as Ray actors, in the foreground
  pdserve up [-c CONFIG] [--address RAY] / down      the same, detached on a running Ray cluster
  pdserve status [--json] / scale prefill=N decode=M  talk to the running deployment (docs/deploy.md)
  pdserve role WORKER prefill|decode --router HOST:PORT  switch a worker's role (docs/operations.md)
  pdserve profile [--quick] [--out FILE]             measure this machine's costs for the simulator (bench/profile.py)
  pdserve plan --profile P --trace F ... --max-gpus N  size P:D, TP and policy by simulation (docs/simulator.md)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import os
import sys
import uuid

from common.config import load_config
from common.engine_config import EngineConfig
from common.errors import EngineError
from common.sampling import SamplingParams
from common.tokenization import encode_prompt
from common.validation import ConfigError
from deploy import commands, role
from router.client import generate_via_router

TOOLS = {"profile": "bench.profile", "plan": "sim.command"}
"""Subcommands with their own parsers (named at run time: bench/ sits above deploy/)."""


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    if raw and raw[0] in TOOLS:
        return importlib.import_module(TOOLS[raw[0]]).main(raw[1:]) or 0
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    where = gen.add_mutually_exclusive_group(required=True)
    where.add_argument("--local", action="store_true", help="run the engine in this process")
    where.add_argument("--router", metavar="HOST:PORT", help="send the request to a running router")
    gen.add_argument("-c", "--config", default=None,
                     help="--local: run the engine of this cluster config as its decode worker would (model, dtype, "
                          "KV pool, pools.decode.tensor_parallel_size)")
    gen.add_argument("--model", default=None, help="--local: the model (default: the config's, else smollm2-135m)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="no chat template: tokenize the prompt as is")
    gen.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, prompt_token_ids)")
    gen.add_argument("--timeout", type=float, default=300.0)
    gen.add_argument("--tls", action="store_true", help="--router serves TLS (verified against the system roots)")
    gen.add_argument("--tls-ca-file", default="", help="--router serves TLS: verify its certificate against this CA (PEM)")
    gen.add_argument("--tls-server-name", default="", help="name expected in the router's certificate (default: the host dialed)")
    gen.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY", ""), help="API key for --router (default: $PDSERVE_API_KEY)")

    model = sub.add_parser("model", help="model utilities")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    fetch = model_sub.add_parser("fetch", help="resolve a model once (converts the demo model into the cache)")
    fetch.add_argument("model", nargs="?", default="smollm2-135m")

    bench = sub.add_parser("bench", help="benchmarks")
    bench.add_argument("name", choices=["engine", "kvtransfer", "peers", "serve", "trace"])
    bench.add_argument("args", nargs=argparse.REMAINDER)

    commands.add_commands(sub)
    role.add_command(sub)
    for name, text in (("profile", "measure this machine for the simulator (pdserve profile --help)"),
                       ("plan", "size a cluster for a workload and SLOs by simulation (pdserve plan --help)")):
        sub.add_parser(name, help=text, add_help=False).add_argument("args", nargs=argparse.REMAINDER)

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command in ("serve", "up", "down", "status", "scale"):
        return commands.run(args)
    if args.command == "role":
        return role.run(args)
    if args.command == "generate":
        return _generate(args)
    if args.command == "model":
        from common.model_files import resolve_model_path

        print(resolve_model_path(args.model))
        return 0
    if args.command == "bench":
        module = {"trace": "experiments.trace_replay", "peers": "experiments.peers"}.get(args.name, args.name)
        return importlib.import_module(f"bench.{module}").main(args.args) or 0
    return 2


def _generate(args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    try:
        if args.local:
            result = _generate_local(args, params)
        else:
            result = generate_via_router(args.router, args.prompt, params, raw=args.raw, timeout=args.timeout, tls=args.tls,
                                         tls_ca_file=args.tls_ca_file, tls_server_name=args.tls_server_name, api_key=args.api_key)
    except (EngineError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"])
    return 0


def _generate_local(args: argparse.Namespace, params) -> dict:
    from engine import Engine  # torch: only for --local

    params.validate()
    config = load_config(args.config).engine_for("decode") if args.config else EngineConfig()
    if args.model:
        config = dataclasses.replace(config, model=args.model)
    engine = Engine(config)
    tokenizer = engine.loaded.tokenizer
    prompt_ids = encode_prompt(tokenizer, args.prompt, raw=args.raw)
    request_id = uuid.uuid4().hex
    engine.add_request(request_id, prompt_ids, params)
    token_ids: list[int] = []
    while engine.has_work():
        for out in engine.step():
            token_ids.extend(out.new_token_ids)
    engine.close()
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    return {"text": text, "token_ids": token_ids, "prompt_token_ids": prompt_ids}


if __name__ == "__main__":
    sys.exit(main())
