# tests/python/test_cli_generate.py: `gpt2attn generate` and `gpt2attn logits` on a tiny checkpoint of
# scripts/make_gpt2_checkpoint.py. generate's --json objects (fields, order, one per prompt); greedy ids are the argmax
# of logits' teacher-forced rows over prompt + new ids, and --logprobs their log-softmax; a seeded sampling run is the
# same at 1 and 2 threads; --stop-ids ends a sequence with "stop"; logits.npy is float32 (T, vocab). Refusals: exit 2,
# one stderr line naming the problem, no output file.
import json
import os
import re
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import parity_common as pc  # noqa: E402
from parity_common import check  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", "make_gpt2_checkpoint.py")
VOCAB, N_POSITIONS = 500, 32
PROMPTS = ([100, 200], [5, 6, 7, 8, 9])  # the first one's greedy ids change in their middle (random tiny models repeat)


def make_checkpoint(out):
    subprocess.run([sys.executable, SCRIPT, out, "--n-embd", "64", "--n-head", "4", "--layers", "2", "--vocab",
                    str(VOCAB), "--n-positions", str(N_POSITIONS), "--seed", "1"], check=True, capture_output=True)
    return out


def ok(r, args):
    p = pc.run_cli(r.cli, args)
    check(p.returncode == 0, "exit %d: %s; stderr: %s" % (p.returncode, pc.fmt_cmd(r.cli, args), p.stderr.strip()))
    return p.stdout


def generate(r, model, prompts, extra, json_out=True):
    args = ["generate", "--model", model, "--max-new-tokens", "8"] + extra + (["--json"] if json_out else [])
    for p in prompts:
        args += ["--prompt-ids", ",".join(map(str, p))]
    out = ok(r, args)
    return [json.loads(line) for line in out.splitlines()] if json_out else out.splitlines()


def logits(r, model, ids, out, extra=()):
    ok(r, ["logits", "--model", model, "--ids", ",".join(map(str, ids)), "--output", out] + list(extra))
    return np.load(out)


def refused(r, args, pattern):
    """Exit 2 with one stderr line matching `pattern` (the bad-input contract)."""
    p = pc.run_cli(r.cli, args)
    msg = p.stderr.strip()
    check(p.returncode == 2, "exit %d (expected 2): %s; stderr %r" % (p.returncode, pc.fmt_cmd(r.cli, args), msg))
    check(len(msg.splitlines()) == 1, "stderr is not one line: %r" % msg)
    check(re.search(pattern, msg), "stderr %r does not match %r" % (msg, pattern))


def json_objects(r, model):
    got = generate(r, model, PROMPTS, ["--logprobs"])
    check(len(got) == 2, "%d objects for 2 prompts" % len(got))
    for g, p in zip(got, PROMPTS):
        keys = ["prompt_ids", "new_ids", "finish_reason", "logprobs", "first_token_ms", "total_ms"]
        check(list(g) == keys, "fields %s, expected %s" % (list(g), keys))
        check(g["prompt_ids"] == p, "prompt_ids %s out of order (expected %s)" % (g["prompt_ids"], p))
        check(len(g["new_ids"]) == 8 and all(0 <= i < VOCAB for i in g["new_ids"]), "new_ids %s" % g["new_ids"])
        check(g["finish_reason"] == "length", "finish_reason %r" % g["finish_reason"])
        check(len(g["logprobs"]) == 8 and all(lp <= 0 for lp in g["logprobs"]), "logprobs %s" % g["logprobs"])
        check(0 <= g["first_token_ms"] <= g["total_ms"], "first_token_ms %s, total_ms %s"
              % (g["first_token_ms"], g["total_ms"]))
    plain = generate(r, model, PROMPTS, [], json_out=False)
    check(plain == [",".join(map(str, g["new_ids"])) for g in got], "plain lines %s differ from --json's" % plain)
    return "2 objects, plain output the same ids"


def greedy_is_argmax(r, model):
    wd = r.workdir()
    for g in generate(r, model, PROMPTS, ["--logprobs"]):
        p, new = g["prompt_ids"], g["new_ids"]
        rows = logits(r, model, p + new[:-1], os.path.join(wd, "l.npy")).astype(np.float64)[len(p) - 1:]
        for k, (row, i) in enumerate(zip(rows, new)):
            check(row[i] >= row.max() - 1e-4, "prompt %s: new id %d (%s) is %d, logit %.6f, but the max is %.6f at %d"
                  % (p, k, new, i, row[i], row.max(), row.argmax()))
        m = rows.max(axis=1, keepdims=True)
        log_softmax = rows - m - np.log(np.exp(rows - m).sum(axis=1, keepdims=True))
        err = np.abs(np.array(g["logprobs"]) - log_softmax[np.arange(len(new)), new]).max()
        check(err < 1e-4, "prompt %s: logprobs differ from log_softmax(logits) by %.3g" % (p, err))
    return "2 prompts, 8 ids each"


def sampling_same_at_threads(r, model):
    args = ["--temperature", "1", "--top-k", "20", "--seed", "7"]
    one = generate(r, model, PROMPTS, args + ["--threads", "1"])
    two = generate(r, model, PROMPTS, args + ["--threads", "2"])
    check([g["new_ids"] for g in one] == [g["new_ids"] for g in two], "threads 1 %s, threads 2 %s"
          % ([g["new_ids"] for g in one], [g["new_ids"] for g in two]))
    greedy = generate(r, model, PROMPTS, [])
    check([g["new_ids"] for g in one] != [g["new_ids"] for g in greedy], "sampling gave the greedy ids")
    return str(one[0]["new_ids"])


def stop_ids(r, model):
    new = generate(r, model, PROMPTS[:1], [])[0]["new_ids"]
    # The first id not seen before it, past the first: the sequence stops in its middle.
    stop = next((i for k, i in enumerate(new) if k > 0 and i not in new[:k]), new[0])
    cut = new[:new.index(stop) + 1]
    g = generate(r, model, PROMPTS[:1], ["--stop-ids", "%d,%d" % (VOCAB - 1 if stop != VOCAB - 1 else 0, stop)])[0]
    check(g["new_ids"] == cut and g["finish_reason"] == "stop", "stop id %d: got %s (%s), expected %s (stop)"
          % (stop, g["new_ids"], g["finish_reason"], cut))
    return "stopped after %d of 8" % len(cut)


def prompts_file(r, model):
    wd = r.workdir()
    path = os.path.join(wd, "prompts.json")
    with open(path, "w") as f:
        json.dump([PROMPTS[1], PROMPTS[0], PROMPTS[1]], f)
    got = [json.loads(line) for line in ok(r, ["generate", "--model", model, "--prompts-file", path,
                                               "--max-new-tokens", "8", "--json"]).splitlines()]
    check([g["prompt_ids"] for g in got] == [PROMPTS[1], PROMPTS[0], PROMPTS[1]], "prompts out of order: %s"
          % [g["prompt_ids"] for g in got])
    check(got[0]["new_ids"] == got[2]["new_ids"], "one prompt twice, greedy: %s and %s"
          % (got[0]["new_ids"], got[2]["new_ids"]))
    return "3 prompts, one repeated"


def logits_file(r, model):
    wd = r.workdir()
    out = os.path.join(wd, "logits.npy")
    lg = logits(r, model, [1, 2, 3, 4], out)
    check(lg.dtype == np.float32 and lg.shape == (4, VOCAB), "dtype %s shape %s" % (lg.dtype, lg.shape))
    check(np.isfinite(lg).all(), "non-finite logits")
    again = logits(r, model, [1, 2], out)  # teacher forced: a prefix's rows are the longer sequence's
    check(np.abs(again - lg[:2]).max() < 1e-4, "a prefix's logits differ from the sequence's")
    return "(4, %d) float32" % VOCAB


def refusals(r, model):
    wd = r.workdir()
    out = os.path.join(wd, "l.npy")
    gen = ["generate", "--model", model, "--max-new-tokens", "4"]
    refused(r, gen + ["--prompt-ids", "1,%d" % VOCAB], r"token id %d at 1 is outside the vocabulary" % VOCAB)
    refused(r, gen + ["--prompt-ids", ",".join(["1"] * N_POSITIONS)],
            r"prompt 0 has %d ids; expected 1 to n_positions - 1 = %d" % (N_POSITIONS, N_POSITIONS - 1))
    refused(r, gen + ["--prompt-ids", "1,x"], r"--prompt-ids '1,x': expected comma-separated token ids, got 'x'")
    refused(r, gen + ["--prompt-ids", "1,2,"], r"--prompt-ids '1,2,': expected comma-separated token ids")
    refused(r, gen + ["--prompt-ids", "1", "--temperature", "1", "--top-p", "1.5"], r"--top-p: must be in \(0, 1\]")
    refused(r, gen + ["--prompt-ids", "1", "--top-k", "5"], r"--top-k applies to sampling only")
    refused(r, gen + ["--prompt-ids", "1", "--stop-ids", str(VOCAB)],
            r"stop token %d is outside the vocabulary" % VOCAB)
    refused(r, ["generate", "--model", os.path.join(wd, "nowhere"), "--prompt-ids", "1", "--max-new-tokens", "1"],
            r"--model .*nowhere.*no such checkpoint directory")
    refused(r, ["generate", "--preset", "gpt2-tiny", "--prompt-ids", "1", "--max-new-tokens", "1"], r"--preset: ")
    refused(r, gen + ["--prompt-ids", "1", "--seed-weights", "3"], r"--seed-weights applies to --preset only")
    lg = ["logits", "--model", model, "--output", out]
    refused(r, lg + ["--ids", "1,%d" % VOCAB], r"token id %d at 1 is outside the vocabulary" % VOCAB)
    refused(r, lg + ["--ids", ",".join(["1"] * (N_POSITIONS + 1))], r"more than n_positions = %d" % N_POSITIONS)
    refused(r, ["logits", "--model", os.path.join(wd, "nowhere"), "--ids", "1", "--output", out],
            r"no such checkpoint directory")
    check(not os.path.exists(out), "a refused logits wrote its output")
    config = os.path.join(model, "config.json")
    refused(r, ["logits", "--model", model, "--ids", "1", "--output", config], r"same file as --model")
    with open(config) as f:
        check(json.load(f)["n_positions"] == N_POSITIONS, "config.json was overwritten")
    return "each refused with its reason"


def main():
    r = pc.Runner("gpt2attn generate and logits")
    model = make_checkpoint(os.path.join(r.tmp, "tiny"))
    r.case("json_objects", json_objects, r, model)
    r.case("greedy_is_argmax", greedy_is_argmax, r, model)
    r.case("sampling_same_at_threads", sampling_same_at_threads, r, model)
    r.case("stop_ids", stop_ids, r, model)
    r.case("prompts_file", prompts_file, r, model)
    r.case("logits_file", logits_file, r, model)
    r.case("refusals", refusals, r, model)
    r.finish()


if __name__ == "__main__":
    main()
