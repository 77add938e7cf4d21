#!/usr/bin/env python3
"""A load generator for `gpt2attn serve`: open-loop Poisson arrivals, streaming requests, latency percentiles.

Requests arrive at --rate per second (exponential gaps, so arrivals do not wait for answers: the queue grows when the
server falls behind, as it would under real clients) for --duration seconds or --requests requests. Each has a prompt
of random ids with a length drawn from --prompt-len and asks for --output-len tokens (stop ids none, so "length" is
the expected finish), streamed. Reported as one JSON object: requests sent, answered, refused (503, by status) and
failed; throughput (answered requests/s, generated tokens/s over the run's wall time); TTFT (request sent to first
token event), inter-token latency (gap between consecutive token events of a stream) and end-to-end latency
percentiles in ms; and the server's /metrics after the run (step-time histogram included).

Distributions: fixed:N, uniform:A:B (integers, inclusive), lognormal:MEDIAN:SIGMA (rounded, at least 1). A prompt plus
its output is cut to the model's n_positions (read from GET /v1/models), the output first.

Usage: bench/load_gen.py (--url http://127.0.0.1:PORT | --cli build/gpt2attn (--model DIR | --preset NAME)
                          [--server-arg=--threads=2 ...]) [--rate 4] [--duration 30 | --requests N]
                          [--prompt-len uniform:16:256] [--output-len uniform:16:128] [--temperature 0] [--seed 0]
With --cli the server is started on a free port (its extra options from --server-arg, repeated) and stopped after.
Needs python3-aiohttp.
"""
import argparse
import asyncio
import json
import math
import random
import re
import signal
import subprocess
import sys
import time

try:
    import aiohttp
except ImportError:
    sys.exit("load_gen.py needs aiohttp (apt-get install python3-aiohttp)")


def distribution(spec):
    """A sampler of positive integers from fixed:N, uniform:A:B or lognormal:MEDIAN:SIGMA."""
    kind, _, args = spec.partition(":")
    try:
        vals = [float(x) for x in args.split(":")] if args else []
        if kind == "fixed" and len(vals) == 1 and vals[0] >= 1:
            n = int(vals[0])
            return lambda rng: n
        if kind == "uniform" and len(vals) == 2 and 1 <= vals[0] <= vals[1]:
            a, b = int(vals[0]), int(vals[1])
            return lambda rng: rng.randint(a, b)
        if kind == "lognormal" and len(vals) == 2 and vals[0] > 0 and vals[1] >= 0:
            mu, sigma = math.log(vals[0]), vals[1]
            return lambda rng: max(1, round(rng.lognormvariate(mu, sigma)))
    except ValueError:
        pass
    raise argparse.ArgumentTypeError("%r: expected fixed:N, uniform:A:B or lognormal:MEDIAN:SIGMA" % spec)


def percentiles(xs):
    if not xs:
        return None
    s = sorted(xs)

    def q(p):  # nearest rank
        return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]

    return {"n": len(s), "mean": sum(s) / len(s), "p50": q(50), "p90": q(90), "p99": q(99), "max": s[-1]}


async def one(session, url, body, stats):
    t0 = time.monotonic()
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                stats["refused"][str(resp.status)] = stats["refused"].get(str(resp.status), 0) + 1
                await resp.read()
                return
            last, tokens, finish = None, 0, None
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if not ev.get("choices"):
                    continue
                c = ev["choices"][0]
                if c.get("finish_reason"):
                    finish = c["finish_reason"]
                    continue
                now = time.monotonic()
                if last is None:
                    stats["ttft_ms"].append((now - t0) * 1e3)
                else:
                    stats["itl_ms"].append((now - last) * 1e3)
                last = now
                tokens += len(c["token_ids"])
            stats["e2e_ms"].append((time.monotonic() - t0) * 1e3)
            stats["answered"] += 1
            stats["tokens"] += tokens
            stats["finish"][finish] = stats["finish"].get(finish, 0) + 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        stats["failed"] += 1
        stats["errors"][type(e).__name__] = stats["errors"].get(type(e).__name__, 0) + 1


async def run(args, url):
    rng = random.Random(args.seed)
    prompt_len, output_len = args.prompt_len, args.output_len
    stats = {"answered": 0, "failed": 0, "tokens": 0, "refused": {}, "errors": {}, "finish": {},
             "ttft_ms": [], "itl_ms": [], "e2e_ms": []}
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.get(url + "/v1/models") as resp:
            model = (await resp.json())["data"][0]
        vocab, n_positions = model["vocab_size"], model["n_positions"]
        tasks, sent = [], 0
        t0 = time.monotonic()
        next_at = t0
        while (args.requests is None and next_at - t0 < args.duration) or (args.requests and sent < args.requests):
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            p = min(prompt_len(rng), n_positions - 1)
            m = min(output_len(rng), n_positions - p)
            body = {"prompt": [rng.randrange(vocab) for _ in range(p)], "max_tokens": m,
                    "temperature": args.temperature, "seed": rng.randrange(2 ** 32), "stream": True}
            tasks.append(asyncio.ensure_future(one(session, url, body, stats)))
            sent += 1
            next_at += rng.expovariate(args.rate)
        await asyncio.gather(*tasks)
        wall = time.monotonic() - t0
        async with session.get(url + "/metrics") as resp:
            metrics_text = await resp.text()
    server = {}
    for line in metrics_text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            server[k] = float(v)
    return {
        "model": model["id"], "rate_per_s": args.rate, "sent": sent, "answered": stats["answered"],
        "refused": stats["refused"], "failed": stats["failed"], "errors": stats["errors"], "finish": stats["finish"],
        "wall_s": wall, "requests_per_s": stats["answered"] / wall, "tokens_per_s": stats["tokens"] / wall,
        "ttft_ms": percentiles(stats["ttft_ms"]), "itl_ms": percentiles(stats["itl_ms"]),
        "e2e_ms": percentiles(stats["e2e_ms"]), "server_metrics": server,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a running server, http://HOST:PORT")
    ap.add_argument("--cli", help="start this gpt2attn binary's serve instead (with --model or --preset)")
    ap.add_argument("--model")
    ap.add_argument("--preset")
    ap.add_argument("--server-arg", action="append", default=[], help="one more serve option, e.g. --server-arg=--threads=2")
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals (without --requests)")
    ap.add_argument("--requests", type=int, help="send this many requests instead of --duration's")
    ap.add_argument("--prompt-len", type=distribution, default=distribution("uniform:16:256"))
    ap.add_argument("--output-len", type=distribution, default=distribution("uniform:16:128"))
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if bool(args.url) == bool(args.cli):
        ap.error("give one of --url and --cli")
    if args.cli and bool(args.model) == bool(args.preset):
        ap.error("--cli needs one of --model and --preset")
    if args.rate <= 0:
        ap.error("--rate must be above 0")

    proc = None
    url = args.url
    if args.cli:
        cmd = [args.cli, "serve", "--port", "0"] + (["--model", args.model] if args.model else ["--preset", args.preset])
        for a in args.server_arg:
            cmd += a.split("=", 1) if a.startswith("--") and "=" in a else [a]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline()
        m = re.fullmatch(r"listening on (http://\S+)\n", line)
        if not m:
            proc.kill()
            sys.exit("the server did not start: %r" % line)
        url = m.group(1)
    try:
        result = asyncio.run(run(args, url))
        if proc:
            result["server_command"] = cmd
    finally:
        if proc:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
