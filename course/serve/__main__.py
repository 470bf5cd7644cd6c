"""`python -m course.serve --port 8000`: the course's engine behind an OpenAI-compatible API.

    python -m course.serve --port 8000                      # SmolLM2-135M-Instruct, chunked prefill
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 16}'
"""
from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m course.serve", description=__doc__.splitlines()[0].strip("`"),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--model", default=None, help="model to load (course.load_model); default: the offline SmolLM2-135M-Instruct")
    p.add_argument("--served-model-name", default=None, help="the name clients send as 'model' (default: the model's)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is a GPU)")
    p.add_argument("--max-running", type=int, default=16, help="requests in the batch at most")
    p.add_argument("--max-waiting", type=int, default=64, help="requests that may wait; more get 429 with Retry-After")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--n-blocks", type=int, default=1024, help="KV cache blocks (their memory is reserved at start)")
    p.add_argument("--chunk-size", type=int, default=256,
                   help="tokens per step, shared by prefill chunks and decodes (chunked prefill); 0: no chunking, "
                        "whole prompts run first (prefill-first)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion (default: what the model and cache allow)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    p.add_argument("--cuda-graphs", action="store_true", help="replay decode steps from CUDA graphs (on a GPU)")
    p.add_argument("--graph-max-len", type=int, default=1024,
                   help="with --cuda-graphs: decode batches whose longest sequence fits this many tokens replay a "
                        "graph (which reads its whole width every step); longer ones run eagerly")
    args = p.parse_args(argv)
    for name in ("max_running", "block_size", "n_blocks", "graph_max_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_waiting < 0 or args.chunk_size < 0:
        p.error("--max-waiting and --chunk-size must be >= 0")
    if 0 < args.chunk_size < args.max_running:
        p.error(f"--chunk-size ({args.chunk_size}) must be 0 or at least --max-running ({args.max_running}): "
                "every running request decodes one token per step")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import uvicorn

    import course
    from course.models import DEFAULT_MODEL
    from course.serve import AsyncEngine, LLMEngine, build_app

    env = course.setup(device=args.device, verbose=False)
    name = args.model or DEFAULT_MODEL
    print(f"loading {name} on {env.device} ({str(env.dtype).removeprefix('torch.')})", file=sys.stderr)
    model = course.load_model(name, device=env.device, dtype=env.dtype)
    tokenizer = course.load_tokenizer(name)
    chunked = args.chunk_size > 0
    n_tokens = args.n_blocks * args.block_size
    core = LLMEngine(model, n_blocks=args.n_blocks, block_size=args.block_size, max_running=args.max_running,
                     budget=args.chunk_size if chunked else min(n_tokens, model.cfg.max_seq_len),
                     policy="chunked" if chunked else "prefill_first", prefix_caching=not args.no_prefix_caching,
                     eos_token_id=tokenizer.eos_token_id, max_model_len=args.max_model_len, graphs=args.cuda_graphs,
                     graph_max_len=args.graph_max_len)
    served = args.served_model_name or name.split("/")[-1]
    app = build_app(AsyncEngine(core, max_waiting=args.max_waiting), tokenizer, served)
    print(f"serving {served!r} on http://{args.host}:{args.port} (max_model_len {core.max_model_len}, "
          f"{'chunked prefill, ' + str(args.chunk_size) + ' tokens per step' if chunked else 'prefill-first'})",
          file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
