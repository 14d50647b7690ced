"""What a compiled kernel's SASS says: its load path and its matrix instructions.

:func:`disassemble` reads the code sections (``.text.<function>``) of many cubins
(``compiled.asm["cubin"]``) and disassembles them in one call of the ``nvdisasm`` Triton bundles
(``triton.knobs.nvidia.nvdisasm``; ``TRITON_NVDISASM_PATH`` overrides it) as one raw instruction
binary for the target: the tool spends ~0.35 s of CPU starting, more than a kernel's disassembly,
and a listing of the concatenated sections, rebased per function, is the same instruction stream
``cuobjdump -sass`` prints per cubin (what :func:`sass_of` runs, and the fallback when a raw batch
fails). :func:`summarize` / :func:`summarize_functions` read a listing:

* ``loads``: the global-load kinds anywhere in the kernel, joined by ``+`` ("-" when none):
  ``tma`` (``UTMALDG``, a tensor-memory-accelerator copy into shared memory), ``ldgsts``
  (``LDGSTS``, cp.async: pointer loads into shared memory) and ``ldg`` (``LDG`` / generic ``LD``:
  pointer loads into registers);
* ``utmaldg`` / ``utmastg``: the number of TMA load / store instructions;
* ``gmma``: warpgroup MMAs (sm_90 wgmma: ``HGMMA`` for 16-bit and tf32 operands, ``QGMMA`` for
  fp8, ``IGMMA`` for int8); ``mma_sync``: warp-level MMAs (``HMMA``; ``QMMA`` is fp8 mma.sync on
  sm_89, ``IMMA`` int8, ``DMMA`` fp64);
* ``loop``: ``"<loads>/<mmas>"`` of the main loop (mmas: ``wgmma``, ``mma.sync``, both joined by
  ``+``, or "-"), "-" when the kernel has none. The main loop is read from the control-flow graph:
  the natural loops (a back edge to a block that dominates its source, so an out-of-line spin wait
  that branches back into a loop belongs to that loop) holding an MMA or a TMA load, innermost
  ones only (a persistent kernel's tile loop holds its K loop and epilogue: the K loop is the main
  one; a warp-specialised kernel's TMA producer loop counts beside its MMA loop), less the
  loop's conditional regions that store to global memory (a flattened persistent loop, tile and K
  loop in one, runs its epilogue there on a tile's last K step: its bias or residual loads are
  not the main loop's).

Counts are static instructions (an unrolled loop body counts each copy), not executed ones.
"""
from __future__ import annotations

import os
import re
import struct
import subprocess
import tempfile

_FUNCTION = re.compile(r"^\s*Function : (\S+)", re.M)
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:(@!?U?P(?:T|\d+))\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
_TARGET = re.compile(r"0x([0-9a-f]+)\s*$")
GMMA = ("HGMMA", "QGMMA", "IGMMA", "BGMMA")
MMA_SYNC = ("HMMA", "QMMA", "IMMA", "DMMA", "BMMA")
LOADS = {"UTMALDG": "tma", "LDGSTS": "ldgsts", "LDG": "ldg", "LD": "ldg"}
LOAD_ORDER = ("tma", "ldgsts", "ldg")
GLOBAL_STORES = ("STG", "ST", "UTMASTG", "UTMAREDG", "RED", "REDG", "ATOM", "ATOMG")
#: the fields :func:`summarize` returns (a cached result without them predates the SASS columns)
FIELDS = ("loads", "utmaldg", "utmastg", "gmma", "mma_sync", "loop")
_BRANCHES = ("BRA",)
_ENDS = ("EXIT", "RET", "BRX", "JMX", "KILL")


def tool_path(name: str) -> str:
    """The ``cuobjdump`` / ``nvdisasm`` binary Triton bundles (or ``TRITON_<NAME>_PATH``); a clear
    error when there is none."""
    from triton import knobs

    try:
        return getattr(knobs.nvidia, name).path
    except RuntimeError as e:
        raise RuntimeError(f"the compile check reads SASS with {name} and found none ({e}): install Triton's NVIDIA "
                           f"backend with its bundled binaries, or set TRITON_{name.upper()}_PATH") from e


def sass_of(cubin: bytes) -> str:
    """``cuobjdump -sass`` of a cubin."""
    tool = tool_path("cuobjdump")
    fd, path = tempfile.mkstemp(suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, "-sass", path], check=True, capture_output=True, text=True).stdout
    finally:
        os.remove(path)


def instructions(text: str) -> list[tuple]:
    """``(address, predicate or None, opcode, operands)`` of one function's listing."""
    return [(int(a, 16), p or None, op, args.strip()) for a, p, op, args in _INSTR.findall(text)]


def functions(sass: str) -> dict:
    """Function name -> its instructions (a cubin may hold device functions beside the kernel)."""
    parts = _FUNCTION.split(sass)
    return {parts[i]: instructions(parts[i + 1]) for i in range(1, len(parts) - 1, 2)}


def text_sections(cubin: bytes) -> dict:
    """Function name -> the bytes of its ``.text.<name>`` section (a 64-bit little-endian ELF)."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<I4xQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = heads[shstrndx][3]  # (name offset, flags, addr, offset, size): the names' section offset
    out = {}
    for name, _, _, off, size in heads:
        n = cubin[names + name:cubin.index(b"\0", names + name)].decode()
        if n.startswith(".text."):
            out[n[len(".text."):]] = cubin[off:off + size]
    return out


def _raw_listing(sections: list, cc: int) -> list[dict] | None:
    """One ``nvdisasm -b SM<cc>`` call over the concatenated ``sections`` (a list of
    ``{function: bytes}``): per entry, function -> its instructions at its own addresses; None
    when the tool reports an error."""
    blob, spans = bytearray(), []
    for funcs in sections:
        spans.append({})
        for name, code in funcs.items():
            spans[-1][name] = (len(blob), len(code))
            blob += code
    fd, path = tempfile.mkstemp(suffix=".bin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        proc = subprocess.run([tool_path("nvdisasm"), "-b", f"SM{cc}", path], capture_output=True, text=True)
    finally:
        os.remove(path)
    if proc.returncode or "error" in proc.stderr:
        return None
    at = {}
    for ins in instructions(proc.stdout):
        at[ins[0]] = ins
    return [{name: [_rebase(at[a], off) for a in range(off, off + size, 16) if a in at]
             for name, (off, size) in funcs.items()} for funcs in spans]


def _rebase(ins, off: int):
    addr, pred, op, args = ins
    if op.split(".")[0] in _BRANCHES and (m := _TARGET.search(args)):
        args = args[:m.start()] + hex(int(m.group(1), 16) - off)
    return (addr - off, pred, op, args)


def disassemble(cubins: list, cc: int, batch_bytes: int = 4 << 20) -> list[dict]:
    """Per cubin, function -> its instructions: raw batches of about ``batch_bytes`` of code
    through one ``nvdisasm`` call each (a batch it rejects: ``cuobjdump -sass`` per cubin)."""
    sections = [text_sections(c) for c in cubins]
    out, start, size = [], 0, 0
    for i in range(len(cubins) + 1):
        if i == len(cubins) or (size and size + sum(map(len, sections[i].values())) > batch_bytes):
            listing = _raw_listing(sections[start:i], cc) if i > start else []
            out += listing if listing is not None else [functions(sass_of(c)) for c in cubins[start:i]]
            start, size = i, 0
        if i < len(cubins):
            size += sum(map(len, sections[i].values()))
    return out


def _blocks(instrs):
    """Basic blocks (lists of instruction indices) and each block's successor blocks."""
    at = {ins[0]: i for i, ins in enumerate(instrs)}
    leaders = {0}
    for i, (_, pred, op, args) in enumerate(instrs):
        base = op.split(".")[0]
        if base in _BRANCHES and (m := _TARGET.search(args)) and int(m.group(1), 16) in at:
            leaders.add(at[int(m.group(1), 16)])
        if base in _BRANCHES or base in _ENDS:
            leaders.add(i + 1)
    starts = sorted(s for s in leaders if s < len(instrs))
    block_of = {s: b for b, s in enumerate(starts)}
    blocks = [list(range(s, e)) for s, e in zip(starts, starts[1:] + [len(instrs)])]
    succ = []
    for b, idx in enumerate(blocks):
        _, pred, op, args = instrs[idx[-1]]
        base, out = op.split(".")[0], set()
        always = pred in (None, "@PT")
        if base in _BRANCHES and (m := _TARGET.search(args)) and int(m.group(1), 16) in at:
            out.add(block_of[at[int(m.group(1), 16)]])
        if not (always and (base in _BRANCHES or base in _ENDS)) and b + 1 < len(blocks):
            out.add(b + 1)
        succ.append(out)
    return blocks, succ


def _dominators(succ) -> list[int]:
    """Per block, the bitset of the blocks that dominate it (iterative data-flow from block 0)."""
    n = len(succ)
    preds = [[] for _ in range(n)]
    for b, out in enumerate(succ):
        for s in out:
            preds[s].append(b)
    full = (1 << n) - 1
    dom = [1] + [full] * (n - 1)
    changed = True
    while changed:
        changed = False
        for b in range(1, n):
            new = full
            for p in preds[b]:
                new &= dom[p]
            new = (new if preds[b] else 0) | (1 << b)
            if new != dom[b]:
                dom[b], changed = new, True
    return dom


def natural_loops(instrs) -> tuple:
    """``(blocks, succ, dom, loops)``: the basic blocks, their successors and dominators, and the
    natural loops (one per header: the union of its back edges' loops) as
    ``{header: (body blocks, latch blocks)}``."""
    blocks, succ = _blocks(instrs) if instrs else ([], [])
    dom = _dominators(succ) if succ else []
    preds = [[] for _ in blocks]
    for b, out in enumerate(succ):
        for s in out:
            preds[s].append(b)
    loops: dict = {}
    for u, out in enumerate(succ):
        for h in out:
            if dom[u] >> h & 1:  # h dominates u: a back edge
                body, latches = loops.setdefault(h, ({h}, set()))
                latches.add(u)
                todo = [u]
                while todo:
                    x = todo.pop()
                    if x not in body:
                        body.add(x)
                        todo += preds[x]
    return blocks, succ, dom, loops


def _kinds(instrs, idx) -> tuple[set, set, dict]:
    loads, mmas, counts = set(), set(), dict(utmaldg=0, utmastg=0, gmma=0, mma_sync=0)
    for i in idx:
        base = instrs[i][2].split(".")[0]
        if base in LOADS:
            loads.add(LOADS[base])
        if base in GMMA:
            mmas.add("wgmma")
            counts["gmma"] += 1
        elif base in MMA_SYNC:
            mmas.add("mma.sync")
            counts["mma_sync"] += 1
        counts["utmaldg"] += base == "UTMALDG"
        counts["utmastg"] += base == "UTMASTG"
    return loads, mmas, counts


def _join(kinds: set, order) -> str:
    return "+".join(k for k in order if k in kinds) or "-"


def _stored_regions(instrs, blocks, succ, dom, body, latches) -> set:
    """The blocks of ``body`` in conditional regions (blocks that do not dominate every latch,
    grouped by the edges between them) that store to global memory: the epilogue of a flattened
    persistent loop (tile and K loop fused, the epilogue run on a tile's last K step)."""
    cond = {b for b in body if not all(dom[latch] >> b & 1 for latch in latches)}
    out = set()
    while cond:
        region, todo = set(), [cond.pop()]
        while todo:
            x = todo.pop()
            region.add(x)
            near = {y for y in cond if y in succ[x] or x in succ[y]}
            cond -= near
            todo += near
        if any(instrs[i][2].split(".")[0] in GLOBAL_STORES for b in region for i in blocks[b]):
            out |= region
    return out


def main_loop(instrs) -> set:
    """Instruction indices of the main loop(s): the innermost natural loops holding an MMA or a
    TMA load, less their conditional regions that store to global memory (:func:`_stored_regions`)."""
    blocks, succ, dom, loops = natural_loops(instrs)
    work = {}
    for h, (body, latches) in loops.items():
        _, mmas, counts = _kinds(instrs, [i for b in body for i in blocks[b]])
        if mmas or counts["utmaldg"]:
            work[h] = (body, latches)
    out = set()
    for h, (body, latches) in work.items():
        if not any(other[0] < body for other in work.values()):
            out |= {i for b in body - _stored_regions(instrs, blocks, succ, dom, body, latches) for i in blocks[b]}
    return out


def summarize(sass: str) -> dict:
    """The SASS columns (:data:`FIELDS`) of a ``cuobjdump -sass`` listing, over all its functions."""
    return summarize_functions(functions(sass))


def summarize_functions(funcs: dict) -> dict:
    """The SASS columns (:data:`FIELDS`) over ``funcs`` (function -> instructions)."""
    loads, mmas, loop_loads, loop_mmas, has_loop = set(), set(), set(), set(), False
    counts = dict(utmaldg=0, utmastg=0, gmma=0, mma_sync=0)
    for instrs in funcs.values():
        ld, mm, c = _kinds(instrs, range(len(instrs)))
        loads |= ld
        mmas |= mm
        counts = {k: counts[k] + c[k] for k in counts}
        loop = main_loop(instrs)
        if loop:
            has_loop = True
            ld, mm, _ = _kinds(instrs, loop)
            loop_loads |= ld
            loop_mmas |= mm
    mma_order = ("wgmma", "mma.sync")
    loop = f"{_join(loop_loads, LOAD_ORDER)}/{_join(loop_mmas, mma_order)}" if has_loop else "-"
    return dict(loads=_join(loads, LOAD_ORDER), **counts, loop=loop)
