# tests/python/test_serve.py: `gpt2attn serve` on a tiny checkpoint of scripts/make_gpt2_checkpoint.py, driven over
# HTTP with aiohttp as clients drive it: 64 concurrent clients (streaming or not, greedy or sampled, some sharing a
# one-block prompt prefix, some disconnecting mid-stream), each answered once with the right number of ids and a
# finish reason, nothing left in the KV cache afterwards; an overloaded server (small cache, short queue) queues or
# refuses with 503 + Retry-After while /health answers; refusals (400, 413) with their JSON error; a client that
# never reads its stream holds up no one; SIGTERM under load ends with exit 0 and every client answered. Batch
# invariance (the server's default): every answer among 63 others, greedy or seeded, equals the same request sent
# alone, ids bitwise; 16 greedy prompts of one request equal each alone in ids and log-probabilities, bitwise; a
# forked prompt equals itself alone. Exit 77 (skipped) without aiohttp.
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

try:
    import aiohttp
except ImportError:
    print("skipped: python3-aiohttp is not installed (apt-get install python3-aiohttp)")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_common as pc  # noqa: E402
from parity_common import check  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "make_gpt2_checkpoint.py")
VOCAB, N_POSITIONS = 500, 128
BLOCK = 64  # the KV cache's block at n_positions 128: min(64, context)
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 30


def make_checkpoint(out):
    subprocess.run([sys.executable, SCRIPT, out, "--n-embd", "64", "--n-head", "4", "--layers", "2", "--vocab",
                    str(VOCAB), "--n-positions", str(N_POSITIONS), "--seed", "1"], check=True, capture_output=True)
    return out


class Server:
    """`gpt2attn serve` on 127.0.0.1, a port it picks; stop() sends SIGTERM and returns (exit code, seconds)."""

    def __init__(self, cli, model, *extra):
        self.args = [cli, "serve", "--model", model, "--host", "127.0.0.1", "--port", "0", "--threads", "1"]
        self.args += list(extra)
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stderr = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        line = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(START_TIMEOUT_S)
        m = re.fullmatch(r"listening on http://127\.0\.0\.1:(\d+)\n", line[0] if line else "")
        if not m:
            self.proc.kill()
            raise pc.CaseFailure("the server did not print its address (got %r; stderr %r)"
                                 % (line, "".join(self.stderr)))
        self.port = int(m.group(1))
        self.url = "http://127.0.0.1:%d" % self.port

    def stop(self):
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise pc.CaseFailure("no exit %d s after SIGTERM" % STOP_TIMEOUT_S)
        return code, time.monotonic() - t0

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def session():
    # A connection per request: a pooled connection the server closed as idle would fail a POST on reuse.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=60))


async def complete(s, url, body, disconnect_after=None):
    """One request: {"status", "ids", "logprobs", "finish_reason", "id", "events", "headers", "error"}; with
    disconnect_after=k, a streaming request drops its connection after k token events ("disconnected")."""
    async with s.post(url + "/v1/completions", json=body) as resp:
        out = {"status": resp.status, "headers": dict(resp.headers)}
        if resp.status != 200 or not body.get("stream"):
            out["json"] = await resp.json(content_type=None)
            if resp.status == 200:
                c = out["json"]["choices"][0]
                out.update(id=out["json"]["id"], ids=c["token_ids"], finish_reason=c["finish_reason"],
                           logprobs=(c["logprobs"] or {}).get("token_logprobs"))
            return out
        check(resp.headers.get("Content-Type", "").startswith("text/event-stream"),
              "stream Content-Type %r" % resp.headers.get("Content-Type"))
        ids, lps, finish, ids_seen, done, events = [], [], None, set(), False, 0
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if not line or line.startswith(":"):
                continue
            check(line.startswith("data: "), "not an SSE data line: %r" % line)
            data = line[len("data: "):]
            check(not done, "an event after [DONE]: %r" % line)
            if data == "[DONE]":
                done = True
                continue
            ev = json.loads(data)
            ids_seen.add(ev["id"])
            events += 1
            if not ev["choices"]:
                check("usage" in ev, "an event with no choice and no usage: %r" % data)
                out["usage"] = ev["usage"]
                continue
            c = ev["choices"][0]
            check(finish is None, "an event after the finish_reason: %r" % data)
            if c["finish_reason"] is not None:
                check(c["token_ids"] == [], "the final event carries ids: %r" % data)
                finish = c["finish_reason"]
                continue
            check(len(c["token_ids"]) == 1, "a token event with %d ids" % len(c["token_ids"]))
            ids += c["token_ids"]
            if body.get("logprobs"):
                lps += c["logprobs"]["token_logprobs"]
            if disconnect_after is not None and len(ids) >= disconnect_after:
                out.update(status="disconnected", ids=ids)
                return out  # leaving the `async with` closes the connection mid-stream
        check(done, "the stream ended without data: [DONE]")
        check(len(ids_seen) == 1, "events of one stream carry ids %s" % ids_seen)
        out.update(id=ids_seen.pop(), ids=ids, finish_reason=finish, logprobs=lps if body.get("logprobs") else None)
        return out


async def get(s, url, path):
    async with s.get(url + path) as resp:
        return resp.status, await resp.text()


def metrics(text):
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


async def settled_metrics(s, url, timeout=15):
    """/metrics once nothing runs or waits and every KV block is free again (a cancelled request is noticed at the
    next write to its client and released at the next step)."""
    deadline = time.monotonic() + timeout
    while True:
        _, text = await get(s, url, "/metrics")
        m = metrics(text)
        idle = m["gpt2attn_requests_running"] == 0 and m["gpt2attn_requests_waiting"] == 0
        if idle and m["gpt2attn_kv_blocks_free"] == m["gpt2attn_kv_blocks_total"]:
            return m
        if time.monotonic() > deadline:
            raise pc.CaseFailure("not settled %d s after the last answer: %s" % (timeout, {
                k: v for k, v in m.items() if "requests_" in k or "kv_blocks" in k}))
        await asyncio.sleep(0.05)


def check_answer(body, r):
    """A completed answer: max_tokens ids ("length"), or fewer ending in a stop id ("stop"), ids in the vocabulary,
    one logprob per id when asked."""
    ids, m = r["ids"], body["max_tokens"]
    check(all(0 <= i < VOCAB for i in ids), "ids outside the vocabulary: %s" % ids)
    if r["finish_reason"] == "length":
        check(len(ids) == m, "finish_reason length with %d ids for max_tokens %d" % (len(ids), m))
    elif r["finish_reason"] == "stop":
        check(0 < len(ids) <= m and ids[-1] in body.get("stop", []) and
              not any(i in body["stop"] for i in ids[:-1]), "finish_reason stop with ids %s, stop %s"
              % (ids, body.get("stop")))
    else:
        raise pc.CaseFailure("finish_reason %r" % r["finish_reason"])
    if body.get("logprobs"):
        check(len(r["logprobs"]) == len(ids) and all(lp <= 0 for lp in r["logprobs"]), "logprobs %s" % r["logprobs"])
    else:
        check(r["logprobs"] is None, "logprobs %s without logprobs" % r["logprobs"])


def concurrent_clients(r, model):
    rng = random.Random(7)
    shared = [rng.randrange(VOCAB) for _ in range(BLOCK + 6)]  # a "system prompt" of one whole block and more
    bodies, disconnect = [], []
    for i in range(64):
        if i % 8 == 0:
            prompt = shared + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))]
        else:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))]
        body = {"prompt": prompt, "max_tokens": rng.randint(1, min(40, N_POSITIONS - len(prompt))),
                "stream": i % 2 == 1, "logprobs": i % 3 == 0}
        if i % 4 < 2:
            body["temperature"] = 0
        else:
            body.update(temperature=0.8, top_k=rng.choice([0, 20]), top_p=rng.choice([1.0, 0.9]), seed=i)
        if i % 5 == 0:
            body["stop"] = [rng.randrange(VOCAB) for _ in range(40)]  # likely to end some choices early
        bodies.append(body)
        disconnect.append(2 if body["stream"] and i % 8 == 3 and body["max_tokens"] > 4 else None)

    async def run():
        async with session() as s:
            srv_url = server.url
            results = await asyncio.gather(*[complete(s, srv_url, b, d) for b, d in zip(bodies, disconnect)])
            settled = await settled_metrics(s, srv_url)
            # The same greedy requests, one at a time: what batching changed.
            greedy = [i for i, b in enumerate(bodies) if b.get("temperature") == 0 and disconnect[i] is None]
            alone = {}
            for i in greedy:
                alone[i] = await complete(s, srv_url, bodies[i])
            sampled = [i for i, b in enumerate(bodies) if b.get("temperature") != 0 and disconnect[i] is None]
            alone_sampled = {}
            for i in sampled:
                alone_sampled[i] = await complete(s, srv_url, bodies[i])
            return results, settled, greedy, alone, sampled, alone_sampled

    server = Server(r.cli, model, "--kv-capacity-tokens", "2048", "--max-batch-tokens", "256")
    try:
        t0 = time.monotonic()
        results, m, greedy, alone, sampled, alone_sampled = asyncio.run(run())
        elapsed = time.monotonic() - t0
        ids = set()
        for b, res, d in zip(bodies, results, disconnect):
            if res["status"] == "disconnected":
                check(len(res["ids"]) == d, "disconnected after %d ids" % len(res["ids"]))
                continue
            check(res["status"] == 200, "status %s: %s" % (res["status"], res.get("json")))
            check_answer(b, res)
            check(res["id"] not in ids, "response id %s given twice" % res["id"])
            ids.add(res["id"])
        finished = sum(m['gpt2attn_requests_total{status="%s"}' % k] for k in ("stop", "length", "cancelled"))
        check(finished == 64, "the server finished %d completions for 64 requests" % finished)
        check(m["gpt2attn_kv_blocks_free"] == m["gpt2attn_kv_blocks_total"], "KV blocks leaked")
        check(m["gpt2attn_prompt_tokens_total"] == sum(len(b["prompt"]) for b in bodies), "prompt tokens %s"
              % m["gpt2attn_prompt_tokens_total"])
        same = sum(alone[i]["ids"] == results[i]["ids"] for i in greedy)
        same_sampled = sum(alone_sampled[i]["ids"] == results[i]["ids"] for i in sampled)
        check(same == len(greedy), "greedy among others == alone for %d of %d" % (same, len(greedy)))
        check(same_sampled == len(sampled), "sampled among others == alone for %d of %d" % (same_sampled, len(sampled)))
        code, _ = server.stop()
        check(code == 0, "exit %d after SIGTERM" % code)
        return ("64 clients in %.1f s, %d disconnected (%d cancelled), %d prefix tokens shared; greedy alone == "
                "among others: %d/%d bitwise, sampled: %d/%d"
                % (elapsed, sum(d is not None for d in disconnect), m['gpt2attn_requests_total{status="cancelled"}'],
                   m["gpt2attn_prefix_tokens_shared_total"], same, len(greedy), same_sampled, len(sampled)))
    finally:
        server.kill()


def prefix_sharing(r, model):
    """Two prompts of one request that begin with the same whole block: the second forks the first's block (the
    metric counts the shared tokens) rather than compute it, and answers with its own max_tokens ids."""
    rng = random.Random(3)
    shared = [rng.randrange(VOCAB) for _ in range(BLOCK + 10)]
    prompts = [shared, shared + [1, 2, 3]]

    async def run():
        async with session() as s:
            async with s.post(server.url + "/v1/completions",
                              json={"prompt": prompts, "max_tokens": 20, "temperature": 0}) as resp:
                both = await resp.json()
            m = await settled_metrics(s, server.url)
            alone = await complete(s, server.url, {"prompt": prompts[1], "max_tokens": 20, "temperature": 0})
            return both, m, alone

    # Batch invariant forks share whole chunks of --max-batch-tokens: one block here.
    server = Server(r.cli, model, "--max-batch-tokens", str(BLOCK))
    try:
        both, m, alone = asyncio.run(run())
        choices = both["choices"]
        check([c["index"] for c in choices] == [0, 1], "choices %s" % choices)
        check(all(len(c["token_ids"]) == 20 and c["finish_reason"] == "length" for c in choices), "choices %s"
              % choices)
        check(both["usage"] == {"prompt_tokens": len(prompts[0]) + len(prompts[1]), "completion_tokens": 40,
                                "total_tokens": len(prompts[0]) + len(prompts[1]) + 40}, "usage %s" % both["usage"])
        shared_tokens = m["gpt2attn_prefix_tokens_shared_total"]
        check(shared_tokens == BLOCK, "%s prefix tokens shared, expected %d" % (shared_tokens, BLOCK))
        check(alone["ids"] == choices[1]["token_ids"], "the forked answer differs from the same prompt's alone")
        code, _ = server.stop()
        check(code == 0, "exit %d" % code)
        return "%d tokens shared; the forked answer %s the same prompt's alone" % (
            shared_tokens, "equals" if alone["ids"] == choices[1]["token_ids"] else "DIFFERS from")
    finally:
        server.kill()


def batch_invariance(r, model):
    """16 greedy prompts in one request (so every step batches them) against each sent alone: ids and
    log-probabilities bitwise equal (RunOptions::batch_invariant, the server's default)."""
    rng = random.Random(13)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 60))] for _ in range(16)]

    async def run():
        async with session() as s:
            async with s.post(server.url + "/v1/completions",
                              json={"prompt": prompts, "max_tokens": 40, "temperature": 0, "logprobs": True}) as resp:
                together = await resp.json()
            alone = [await complete(s, server.url, {"prompt": p, "max_tokens": 40, "temperature": 0,
                                                    "logprobs": True}) for p in prompts]
            return together, alone

    server = Server(r.cli, model, "--kv-capacity-tokens", "2048")
    try:
        together, alone = asyncio.run(run())
        choices = together["choices"]
        check(len(choices) == 16 and all(len(c["token_ids"]) == 40 for c in choices), "choices %s" % choices)
        same_ids = sum(c["token_ids"] == a["ids"] for c, a in zip(choices, alone))
        same_lps = sum(c["logprobs"]["token_logprobs"] == a["logprobs"] for c, a in zip(choices, alone))
        worst = max(abs(x - y) for c, a in zip(choices, alone)
                    for x, y in zip(c["logprobs"]["token_logprobs"], a["logprobs"]))
        check(same_ids == 16 and same_lps == 16, "alone != among others: ids %d/16, log-probabilities %d/16 "
              "(largest difference %.3g)" % (same_ids, same_lps, worst))
        code, _ = server.stop()
        check(code == 0, "exit %d" % code)
        return ("greedy among 15 others == alone: ids %d/16, logprobs bitwise %d/16 (largest difference %.3g)"
                % (same_ids, same_lps, worst))
    finally:
        server.kill()


def overload(r, model):
    """Two blocks of cache (one request at a time) and a queue of 4, under 32 clients that each send again as soon
    as they are answered, for 2 s: requests are answered or refused with 503 + Retry-After, never dropped; /health
    answers within a second throughout; afterwards nothing is held."""
    rng = random.Random(11)
    load_s = 2.0

    async def run():
        async with session() as s:
            t_end = time.monotonic() + load_s
            health, results = [], []

            async def probe():
                while time.monotonic() < t_end:
                    t0 = time.monotonic()
                    status, text = await get(s, server.url, "/health")
                    health.append((status, text, time.monotonic() - t0))
                    await asyncio.sleep(0.02)

            async def client(i):
                while time.monotonic() < t_end:
                    body = {"prompt": [rng.randrange(VOCAB) for _ in range(20)], "max_tokens": 100,
                            "temperature": 0, "stream": i % 2 == 0}
                    results.append(await complete(s, server.url, body))

            await asyncio.gather(probe(), *[client(i) for i in range(32)])
            m = await settled_metrics(s, server.url)
            return results, health, m

    server = Server(r.cli, model, "--kv-capacity-tokens", "128", "--max-queue", "4")
    try:
        results, health, m = asyncio.run(run())
        ok = [x for x in results if x["status"] == 200]
        busy = [x for x in results if x["status"] == 503]
        check(len(ok) + len(busy) == len(results), "statuses %s" % sorted({x["status"] for x in results}))
        for x in ok:
            check(len(x["ids"]) == 100 and x["finish_reason"] == "length", "an answer of %d ids" % len(x["ids"]))
        for x in busy:
            check(x["headers"].get("Retry-After") == "1", "503 without Retry-After: %s" % x["headers"])
            check(x["json"]["error"]["code"] == "queue_full", "503 error %s" % x["json"])
        check(len(ok) >= 5 and busy, "%d answered, %d refused: expected both" % (len(ok), len(busy)))
        check(len(health) >= 10 and all(h[0] == 200 and json.loads(h[1]) == {"status": "ok"} for h in health),
              "/health: %d answers, %s" % (len(health), health[:3]))
        worst = max(h[2] for h in health)
        check(worst < 1.0, "/health took %.2f s" % worst)
        check(m['gpt2attn_requests_total{status="queue_full"}'] == len(busy), "queue_full metric")
        check(m['gpt2attn_requests_total{status="length"}'] == len(ok), "length metric")
        code, _ = server.stop()
        check(code == 0, "exit %d" % code)
        return "%d answered, %d refused with 503 in %.0f s; /health answered %d times, slowest %.0f ms" % (
            len(ok), len(busy), load_s, len(health), worst * 1e3)
    finally:
        server.kill()


def refusals(r, model):
    async def post_raw(s, data, headers=None):
        async with s.post(server.url + "/v1/completions", data=data,
                          headers=headers or {"Content-Type": "application/json"}) as resp:
            return resp.status, await resp.json(content_type=None)

    cases = [
        ("malformed JSON", b'{"prompt": [1, 2', 400, "invalid_json"),
        ("not an object", b"[1, 2]", 400, None),
        ("text prompt", json.dumps({"prompt": "hello"}).encode(), 400, None),
        ("float id", json.dumps({"prompt": [1, 2.5]}).encode(), 400, None),
        ("no prompt", json.dumps({"max_tokens": 3}).encode(), 400, None),
        ("empty prompt", json.dumps({"prompt": []}).encode(), 400, None),
        ("string max_tokens", json.dumps({"prompt": [1], "max_tokens": "3"}).encode(), 400, None),
        ("max_tokens 0", json.dumps({"prompt": [1], "max_tokens": 0}).encode(), 400, None),
        ("negative temperature", json.dumps({"prompt": [1], "temperature": -1}).encode(), 400, None),
        ("top_p 1.5", json.dumps({"prompt": [1], "top_p": 1.5, "temperature": 1}).encode(), 400, None),
        ("top_k -1", json.dumps({"prompt": [1], "top_k": -1}).encode(), 400, None),
        ("stream not bool", json.dumps({"prompt": [1], "stream": "yes"}).encode(), 400, None),
        ("n 2", json.dumps({"prompt": [1], "n": 2}).encode(), 400, None),
        ("id past vocab", json.dumps({"prompt": [1, VOCAB]}).encode(), 400, None),
        ("negative id", json.dumps({"prompt": [-1]}).encode(), 400, None),
        ("stop past vocab", json.dumps({"prompt": [1], "stop": [VOCAB]}).encode(), 400, None),
        ("past the context", json.dumps({"prompt": [1] * 100, "max_tokens": 29}).encode(), 413,
         "context_length_exceeded"),
        ("huge max_tokens", json.dumps({"prompt": [1], "max_tokens": 2 ** 63 - 1}).encode(), 413,
         "context_length_exceeded"),
        ("body over 1 MiB", json.dumps({"prompt": [1] * 400000}).encode(), 413, "payload_too_large"),
    ]

    async def run():
        async with session() as s:
            got = []
            for name, data, status, code in cases:
                got.append((name, status, code) + await post_raw(s, data))
            # The context's edge is allowed: prompt + max_tokens == n_positions.
            edge = await complete(s, server.url, {"prompt": [1] * 100, "max_tokens": 28, "temperature": 0})
            unknown = await get(s, server.url, "/v1/nothing")
            models = await get(s, server.url, "/v1/models")
            return got, edge, unknown, models

    server = Server(r.cli, model)
    try:
        got, edge, unknown, models = asyncio.run(run())
        model_info = json.loads(models[1])["data"][0]
        check(models[0] == 200 and model_info["id"] == "tiny" and model_info["vocab_size"] == VOCAB and
              model_info["n_positions"] == N_POSITIONS, "/v1/models: %s" % (models,))
        for name, status, code, got_status, body in got:
            check(got_status == status, "%s: status %d, expected %d (%s)" % (name, got_status, status, body))
            err = body.get("error") if isinstance(body, dict) else None
            check(isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"] and
                  isinstance(err.get("type"), str) and "code" in err, "%s: error body %s" % (name, body))
            check(code is None or err["code"] == code, "%s: code %r, expected %r" % (name, err["code"], code))
        check(edge["status"] == 200 and len(edge["ids"]) == 28, "prompt + max_tokens == n_positions: %s" % edge)
        check(unknown[0] == 404 and "error" in json.loads(unknown[1]), "unknown path: %s" % (unknown,))
        code, _ = server.stop()
        check(code == 0, "exit %d" % code)
        return "%d refusals, each with its status and JSON error" % len(got)
    finally:
        server.kill()


def slow_client(r, model):
    """A client that sends a streaming request and never reads: 8 others, sent after it, finish within 10 s."""
    server = Server(r.cli, model, "--kv-capacity-tokens", "1024")
    sock = None
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's writes block
        sock.connect(("127.0.0.1", server.port))
        body = json.dumps({"prompt": [5] * 10, "max_tokens": 110, "stream": True, "logprobs": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(0.2)

        async def run():
            async with session() as s:
                t0 = time.monotonic()
                res = await asyncio.wait_for(asyncio.gather(*[
                    complete(s, server.url, {"prompt": [i + 1] * 5, "max_tokens": 30, "stream": i % 2 == 0})
                    for i in range(8)]), timeout=10)
                return res, time.monotonic() - t0

        res, elapsed = asyncio.run(run())
        check(all(x["status"] == 200 and len(x["ids"]) == 30 for x in res), "others: %s" % res)
        code, seconds = server.stop()  # the slow client still connected, still not reading
        check(code == 0, "exit %d" % code)
        check(seconds < 15, "exit %.1f s after SIGTERM beside a client that does not read" % seconds)
        return "8 others answered in %.2f s beside a client that never read; exit 0 %.1f s after SIGTERM" % (
            elapsed, seconds)
    finally:
        if sock:
            sock.close()
        server.kill()


def sigterm_under_load(r, model, shutdown_s):
    """SIGTERM while 48 clients are running or queued (one request at a time fits the cache): exit 0 within
    --shutdown-timeout plus a margin, and every client has a whole answer (finish_reason "length", or "cancelled"
    with the ids so far once the timeout passed), a 503, or a refused connection once the server is gone: never a
    cut stream. With a timeout of 0 what runs is cancelled at once; with 10 all of it finishes."""
    rng = random.Random(5)
    bodies = [{"prompt": [rng.randrange(VOCAB) for _ in range(10)], "max_tokens": 100, "temperature": 0,
               "stream": i % 2 == 0} for i in range(48)]
    server = Server(r.cli, model, "--kv-capacity-tokens", "128", "--shutdown-timeout", str(shutdown_s),
                    "--max-queue", "64")

    async def one(s, b):
        try:
            return await complete(s, server.url, b)
        except aiohttp.ClientConnectorError:
            return {"status": "refused"}

    async def run():
        async with session() as s:
            tasks = [asyncio.ensure_future(one(s, b)) for b in bodies]
            # SIGTERM once the first answers are out: the rest run or wait.
            while sum(t.done() for t in tasks) < 2:
                await asyncio.sleep(0.005)
            loop = asyncio.get_running_loop()
            stopped = loop.run_in_executor(None, server.stop)
            await asyncio.sleep(0.05)
            late = [asyncio.ensure_future(one(s, bodies[0])) for _ in range(4)]  # sent while shutting down
            results = await asyncio.gather(*tasks)
            late_results = await asyncio.gather(*late)
            code, seconds = await stopped
            return results, late_results, code, seconds

    try:
        results, late, code, seconds = asyncio.run(run())
        check(code == 0, "exit %d after SIGTERM; stderr %r" % (code, "".join(server.stderr)))
        check(seconds < shutdown_s + 10, "exit %.1f s after SIGTERM" % seconds)
        counts = {}
        for b, x in zip(bodies, results):
            if x["status"] == 200:
                reason = x["finish_reason"]
                check(reason in ("length", "cancelled"), "finish_reason %r" % reason)
                check(len(x["ids"]) == 100 if reason == "length" else len(x["ids"]) < 100,
                      "%s with %d ids" % (reason, len(x["ids"])))
            else:
                check(x["status"] in (503, "refused"), "status %s" % x["status"])
                reason = str(x["status"])
            counts[reason] = counts.get(reason, 0) + 1
        for x in late:
            check(x["status"] in (503, "refused"), "a request sent while shutting down: %s" % x["status"])
        if shutdown_s == 0:
            check(counts.get("cancelled", 0) > 0, "nothing was cancelled: %s" % counts)
        else:
            check(counts == {"length": len(bodies)}, "not every request finished: %s" % counts)
        return "exit 0 in %.1f s; %s" % (seconds, ", ".join("%s: %d" % kv for kv in sorted(counts.items())))
    finally:
        server.kill()


def main():
    r = pc.Runner("gpt2attn serve")
    model = make_checkpoint(os.path.join(r.tmp, "tiny"))
    r.case("refusals", refusals, r, model)
    r.case("concurrent_clients", concurrent_clients, r, model)
    r.case("prefix_sharing", prefix_sharing, r, model)
    r.case("batch_invariance", batch_invariance, r, model)
    r.case("overload", overload, r, model)
    r.case("slow_client", slow_client, r, model)
    r.case("sigterm_cancels_at_timeout_0", sigterm_under_load, r, model, 0)
    r.case("sigterm_finishes_within_timeout", sigterm_under_load, r, model, 10)
    r.finish()


if __name__ == "__main__":
    main()
