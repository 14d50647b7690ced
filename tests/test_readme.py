"""The examples of README.md and of the user guide docs/GUIDE.md run as written, so the documents
cannot drift from the code; their links point to files and headings that exist.

Every ```python block of those documents declares how it runs in its first line, a comment:

* ``# preamble: ...``: the single-process preamble (one per document); it runs alone too.
* ``# after the preamble above``: a single-process example; runs as the preamble + the block.
* ``# NAME.py: python NAME.py``: a complete single-process script.
* ``# NAME.py: torchrun --nproc-per-node N NAME.py``: a script for a world of ``N`` processes
  (gloo here, under the interpreter), optionally ``(after the preamble above)``.
* ``# NAME.py continued``: more of script ``NAME.py``; it runs inside that script, before the
  script's last ``destroy_process_group()`` line (or at its end when it has none).
* ``(GPU only)`` anywhere in that first line: skipped without a GPU.

A python block without one of these fails :func:`test_every_python_block_declares_how_it_runs`.
Single-process blocks run in this process (the interpreter is on, see conftest.py). Each
torchrun script runs once, under ``python -m torch.distributed.run`` as a user starts it, in the
same launch as the other scripts of its world size (:func:`test_torchrun_examples`). The
Hugging Face blocks' ``path/to/<model>`` placeholders are tiny random checkpoints written with
``save_pretrained`` into ``tmp_path``. The shell commands that matter run too: the first
benchmark command (CPU smoke mode, from the repository root as the README says), and every
``python -m benchmarks`` op and ``fusedpar.demo`` option the README names must exist.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
# the documents whose examples run (paths relative to ROOT); script names are unique across them
DOCS = ("README.md", "docs/GUIDE.md")

PREAMBLE = re.compile(r"# preamble\b")
AFTER = re.compile(r"# after the preamble above\b")
SCRIPT = re.compile(r"# (?P<file>\w+\.py): (?:python (?P=file)|torchrun --nproc-per-node (?P<n>\d+) (?P=file))\b")
CONTINUED = re.compile(r"# (?P<file>\w+\.py) continued\b")
GPU_ONLY = "(GPU only)"
# the Hugging Face placeholders -> the tiny model family (tests/_hf.py) saved in their place
HF_PATHS = {"path/to/Llama-3.1-8B": "llama31", "path/to/Mixtral-8x7B-v0.1": "mixtral"}


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str

    @property
    def first(self) -> str:
        return self.code.split("\n", 1)[0].strip()


@dataclass
class Script:
    name: str
    nproc: int | None  # None: a single process
    code: str
    lines: list = field(default_factory=list)  # lines of its blocks in its document
    gpu_only: bool = False
    doc: str = "README.md"

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.lines[0]}"


def readme_blocks(text: str) -> list[Block]:
    blocks, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        m = re.fullmatch(r"```(\w*)\s*", lines[i])
        if not m:
            i += 1
            continue
        start, i = i, i + 1
        while not lines[i].startswith("```"):
            i += 1
        blocks.append(Block(start + 1, m.group(1), "\n".join(lines[start + 1:i]) + "\n"))
        i += 1
    return blocks


def _insert_before_destroy(code: str, more: str) -> str:
    lines = code.rstrip("\n").split("\n")
    at = max((i for i, s in enumerate(lines) if "destroy_process_group()" in s), default=len(lines))
    return "\n".join(lines[:at] + more.rstrip("\n").split("\n") + lines[at:]) + "\n"


def plan(blocks: list[Block], doc: str = "README.md") -> tuple[dict[str, Script], list[str]]:
    """The runnable scripts of one document's python blocks (name -> Script), and the blocks
    that declare no way to run."""
    preamble, scripts, undeclared = None, {}, []
    for b in (b for b in blocks if b.lang == "python"):
        first, gpu = b.first, GPU_ONLY in b.first
        after = "after the preamble above" in first
        if PREAMBLE.match(first):
            preamble = b.code
            name = f"{doc}:{b.line}:preamble"
            scripts[name] = Script(name, None, b.code, [b.line], gpu, doc)
        elif AFTER.match(first) or SCRIPT.match(first):
            if after and preamble is None:
                undeclared.append(f"{doc}:{b.line}: 'after the preamble above' but no preamble before it")
                continue
            m = SCRIPT.match(first)
            name = m.group("file") if m else f"{doc}:{b.line}"
            nproc = int(m.group("n")) if m and m.group("n") else None
            scripts[name] = Script(name, nproc, (preamble if after else "") + b.code, [b.line], gpu, doc)
        elif m := CONTINUED.match(first):
            s = scripts.get(m.group("file"))
            if s is None:
                undeclared.append(f"{doc}:{b.line}: continues {m.group('file')}, which no block above starts")
                continue
            s.code = _insert_before_destroy(s.code, b.code)
            s.lines.append(b.line)
            s.gpu_only |= gpu
        else:
            undeclared.append(f"{doc}:{b.line}: {first!r}")
    return scripts, undeclared


def _read(rel: str) -> str:
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def _readme() -> str:
    return _read("README.md")


def plan_documents(docs=DOCS) -> tuple[dict[str, Script], list[str]]:
    """Every document's scripts in one table; a script name two documents use is an error."""
    scripts, undeclared = {}, []
    for doc in docs:
        mine, bad = plan(readme_blocks(_read(doc)), doc)
        undeclared += bad
        for name in mine.keys() & scripts.keys():
            undeclared.append(f"{mine[name].where}: script {name} is also {scripts[name].where}")
        scripts.update(mine)
    return scripts, undeclared


SCRIPTS, UNDECLARED = plan_documents()
SINGLE = sorted(n for n, s in SCRIPTS.items() if s.nproc is None)
WORLDS = sorted({s.nproc for s in SCRIPTS.values() if s.nproc is not None})


def test_every_python_block_declares_how_it_runs():
    assert not UNDECLARED, ("README / guide python blocks must start with a run declaration (see this module's "
                            "docstring):\n" + "\n".join(UNDECLARED))
    # the guide's known examples are all found (a parser that silently skips blocks would pass)
    assert {"tp_example.py", "sp_example.py", "transformer_example.py", "hf_example.py", "hf_route_b.py",
            "placements_example.py"} <= set(SCRIPTS), sorted(SCRIPTS)
    assert len(SINGLE) >= 8, SINGLE
    assert {s.doc for s in SCRIPTS.values()} == set(DOCS)


def test_the_planner_reads_declarations():
    text = ("```python\n# preamble: x\na = 1\n```\n```python\n# after the preamble above\nb = a\n```\n"
            "```python\n# w.py: torchrun --nproc-per-node 3 w.py (GPU only)\nc = 1\ndestroy_process_group()\n```\n"
            "```python\n# w.py continued\nd = 2\n```\n```python\nprint(1)\n```\n```bash\nls\n```\n")
    scripts, undeclared = plan(readme_blocks(text))
    assert scripts["README.md:5"].code == "# preamble: x\na = 1\n# after the preamble above\nb = a\n"
    w = scripts["w.py"]
    assert (w.nproc, w.gpu_only, w.lines) == (3, True, [9, 14])
    assert w.code.split("\n")[-2:] == ["destroy_process_group()", ""] and "d = 2\ndestroy" in w.code
    assert undeclared == ["README.md:18: 'print(1)'"]


def _skip_gpu_only(script: Script):
    if script.gpu_only and not torch.cuda.is_available():
        pytest.skip(f"{script.where} is GPU only")


@pytest.mark.parametrize("name", SINGLE)
def test_single_process_example(name, tmp_path, monkeypatch):
    script = SCRIPTS[name]
    _skip_gpu_only(script)
    if torch.cuda.is_available() and os.environ.get("FUSEDPAR_TEST_DEVICE") == "cpu":
        pytest.skip("the preamble picks the GPU; this run forces the interpreter")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    with torch.random.fork_rng():  # the examples seed the global generator
        exec(compile(script.code, script.where, "exec"), namespace)


def _hf_checkpoints(tmp_path) -> dict[str, str]:
    from _hf import hf_model

    out = {}
    for placeholder, family in HF_PATHS.items():
        path = tmp_path / f"hf_{family}"
        if not path.exists():
            hf_model(family).save_pretrained(path)
        out[placeholder] = str(path)
    return out


def _script_source(script: Script, paths: dict[str, str]) -> str:
    code = script.code
    for placeholder, path in paths.items():
        code = code.replace(placeholder, path)
    unknown = re.findall(r"path/to/[\w.-]+", code)
    assert not unknown, f"{script.where}: no stand-in checkpoint for {unknown} (HF_PATHS)"
    return code


# ----------------------------------------------------------------------------------------------
# the torchrun examples: one launch per world size, the scripts one after the other in it
# ----------------------------------------------------------------------------------------------
def _gpu_world(nproc: int) -> bool:
    """Whether a world of ``nproc`` runs one rank per GPU here (else: the CPU path)."""
    return os.environ.get("FUSEDPAR_TEST_DEVICE") == "cuda" and torch.cuda.device_count() >= nproc


def _torchrun(nproc: int, scripts: list[str], cwd, timeout: float = 400):
    from fusedpar.kernels.interpreter import interpreter_problem

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)  # the preamble decides, as on a user's machine
    if not _gpu_world(nproc):
        env["CUDA_VISIBLE_DEVICES"] = ""  # one GPU per rank or none: the CPU path (gloo, interpreter)
        problem = interpreter_problem()
        if problem:
            pytest.skip(problem)
    runner = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_readme_world.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           runner, *scripts]
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # torchrun and its workers: a new session of their own
        out, err = proc.communicate()
        pytest.fail(f"README examples {scripts} did not finish within {timeout:.0f}s:\n{(out + err)[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.world
@pytest.mark.parametrize("nproc", WORLDS)
def test_torchrun_examples(nproc, tmp_path):
    """Each torchrun example of this world size runs once, under one torchrun launch (the
    processes import torch, triton and transformers once): tests/_readme_world.py gives each
    script a fresh rendezvous store, so its own ``init_process_group`` / ``init_parallel`` joins
    a clean world, and fails the launch on the first script that raises."""
    scripts = [s for s in SCRIPTS.values() if s.nproc == nproc and (_gpu_world(nproc) or not s.gpu_only)]
    if not scripts:
        pytest.skip(f"every {nproc}-process example is GPU only")
    needs_hf = any(p in s.code for s in scripts for p in HF_PATHS)
    paths = _hf_checkpoints(tmp_path) if needs_hf else {}
    files = []
    for s in scripts:
        (tmp_path / s.name).write_text(_script_source(s, paths))
        files.append(s.name)
    proc = _torchrun(nproc, files, tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"README examples {files} failed ({proc.returncode}):\n{out[-6000:]}"
    for name in files:
        for rank in range(nproc):
            assert f"README example {name} done on rank {rank}" in proc.stdout, out[-6000:]
    assert "terminate called" not in out, out[-6000:]


# ----------------------------------------------------------------------------------------------
# shell commands
# ----------------------------------------------------------------------------------------------
def _section(heading: str) -> str:
    text = _readme()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def _bash_lines(section_text: str) -> list[str]:
    """The commands of a section's ```bash blocks: comments dropped, continuations joined."""
    lines = []
    for b in readme_blocks(section_text):
        if b.lang == "bash":
            joined = re.sub(r"\\\n\s*", "", b.code)
            lines += [re.sub(r"\s+#.*$", "", s).strip() for s in joined.split("\n")]
    return [s for s in lines if s and not s.startswith("#")]


def test_first_benchmark_command_finishes_on_this_machine(tmp_path, monkeypatch, capsys):
    """The first benchmark command, as written, from the repository root (the README says so:
    ``benchmarks`` is not installed): on a CPU machine the smoke mode caps its GPU shape."""
    section = _section("Benchmarks")
    assert "repository root" in section
    first = _bash_lines(section)[0]
    assert first.startswith("python -m benchmarks matmul "), first
    monkeypatch.syspath_prepend(ROOT)
    monkeypatch.chdir(tmp_path)  # its --json file lands here
    from benchmarks.__main__ import main

    assert main(shlex.split(first)[3:]) == 0
    out = capsys.readouterr().out
    assert "### matmul" in out
    if not torch.cuda.is_available():
        assert "shapes capped at 64 per dimension (4096x4096x4096 ran as 64x64x64)" in out, out


def test_readme_commands_name_existing_ops_and_options(monkeypatch):
    """Every ``python -m benchmarks <op>`` the README shows is an op, and every demo command line
    parses with the demo's own options (nothing runs: the demo's runs are tests/test_demo.py)."""
    monkeypatch.syspath_prepend(ROOT)
    from benchmarks.__main__ import _load_ops
    from benchmarks._common import REGISTRY
    from fusedpar.demo import parse_args

    _load_ops()
    text = "".join(_read(doc) for doc in DOCS)
    ops = set(re.findall(r"python -m\s+benchmarks ([a-z0-9_]+)", text))
    assert ops and ops <= set(REGISTRY) | {"all", "compile", "report"}, ops - set(REGISTRY)
    listed = set(re.findall(r"`([a-z0-9_]+)`", _section("Benchmarks").split("Ops:", 1)[1].split("\n\n")[0]))
    assert listed - {"all"} == set(REGISTRY), (listed, set(REGISTRY))
    demo = [s for s in _bash_lines(_section("Demo")) if "fusedpar.demo" in s or "DEMO_ARGS" in s]
    assert len(demo) >= 9, demo
    for line in demo:
        args = line.split("-m fusedpar.demo", 1)[1] if "-m fusedpar.demo" in line else line.split("DEMO_ARGS=", 1)[1]
        parse_args(shlex.split(args.strip().strip('"')))


# ----------------------------------------------------------------------------------------------
# links
# ----------------------------------------------------------------------------------------------
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a Markdown text's headings (outside code blocks): lower case, spaces to
    hyphens, punctuation other than ``-`` and ``_`` dropped."""
    anchors, fenced = set(), False
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.*)", line)):
            anchors.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def broken_links(rel: str) -> list[str]:
    """The relative links of document ``rel`` whose file or heading does not exist."""
    bad, text = [], _read(rel)
    for n, line in enumerate(text.split("\n"), 1):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(os.path.dirname(rel), path)) if path else rel
            if not os.path.exists(os.path.join(ROOT, file)):
                bad.append(f"{rel}:{n}: {target} (no file {file})")
            elif anchor and file.endswith(".md") and anchor not in heading_anchors(_read(file)):
                bad.append(f"{rel}:{n}: {target} (no heading #{anchor} in {file})")
    return bad


def test_links_point_to_existing_files_and_headings():
    docs = [*DOCS, *(os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs"))) if f.endswith(".md"))]
    assert "docs/DESIGN.md" in docs and "docs/PERF.md" in docs
    bad = [b for doc in dict.fromkeys(docs) for b in broken_links(doc)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_heading_anchors_follow_github():
    text = "# A b\n## 4.1 GEMM (`matmul`, `matmul_tn`)\n```\n# not a heading\n```\n### torch.compile\n"
    assert heading_anchors(text) == {"a-b", "41-gemm-matmul-matmul_tn", "torchcompile"}
