# tests/python/test_cli_reference.py: docs/cli.md carries `gpt2attn --help`, which the CLI renders from its option
# table (tools/cli/options.cpp), verbatim between two markers; this fails when the two differ. After changing an
# option, regenerate the page's block with: python3 tests/python/test_cli_reference.py --cli build/gpt2attn --write
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "cli.md")
BEGIN = "<!-- generated: gpt2attn --help (tests/python/test_cli_reference.py --write) -->"
END = "<!-- end of generated -->"


def rendered(cli):
    p = subprocess.run([cli, "--help"], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise SystemExit("gpt2attn --help exited %d: %s" % (p.returncode, p.stderr))
    return "```\n" + p.stdout.rstrip("\n") + "\n```"


def split_page(text):
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise SystemExit("%s: the generated block's markers are missing or out of order" % PAGE)
    head, rest = text.split(BEGIN)
    block, tail = rest.split(END)
    return head, block.strip("\n"), tail


def main():
    write = "--write" in sys.argv
    if write:
        sys.argv.remove("--write")
    import parity_common as pc  # after --write is gone: the runner parses --cli and -k
    r = pc.Runner("docs/cli.md against gpt2attn --help")
    with open(PAGE) as f:
        text = f.read()
    head, block, tail = split_page(text)
    want = rendered(r.cli)
    if write:
        with open(PAGE, "w") as f:
            f.write(head + BEGIN + "\n" + want + "\n" + END + tail)
        print("wrote %s" % PAGE)
        block = want

    def same():
        if block != want:
            got, exp = block.splitlines(), want.splitlines()
            line = next((i for i, (a, b) in enumerate(zip(got, exp)) if a != b), min(len(got), len(exp)))
            pc.check(False, "docs/cli.md differs from gpt2attn --help from line %d of the block: %r against %r "
                            "(regenerate with --write)" % (line + 1, got[line] if line < len(got) else None,
                                                           exp[line] if line < len(exp) else None))
    r.case("docs_cli_md_is_the_help_text", same)
    r.finish()


if __name__ == "__main__":
    main()
