"""Ahead-of-time compilation of our Triton kernels for AMD and NVIDIA targets, without the hardware.

The PyPI ``triton`` wheel carries both backends, so a CPU-only machine can lower every kernel to
AMDGCN (gfx950 = MI350X/MI355X, gfx942 = MI300X/MI325X) and to PTX (sm_90 = H100/H200) and read
what the hardware would run: matrix instructions (``v_mfma_*``, ``v_mfma_scale_f32_*_f8f6f4``,
``wgmma.mma_async``), register counts, spills and LDS (shared memory) bytes. This is how CI proves
the kernels are HIP-ready (HARDWARE.md, "Ahead-of-time compile").

Each kernel family (``k3rocm.kernels.<family>``) exposes ``isa_cases()`` returning a list of
``(name, fn, signature, constexprs, expects_matrix)`` or the same with a 6th element
``options: dict[str, dict]`` keyed by backend (``"hip"`` / ``"cuda"``) with compile options
(``num_warps``, ``num_stages``, ``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``); a backend's entry may
also carry ``"constexprs"``: values that replace the case's constexprs on that backend (a kernel with a
CUDA-only inline-PTX branch switches it off for HIP this way).

Integer arguments: at run time Triton's launcher specialises every integer argument that is a multiple of 16
(unless the kernel lists it in ``do_not_specialize``), and the compiler then proves the alignment it needs for
vector loads (16-byte ``cp.async`` instead of 4-byte, ``global_load_dwordx4`` instead of dwords). An
ahead-of-time signature has no values, so a case states it: the type ``"i32:16"`` / ``"i64:16"`` (see
:func:`specialize`) marks an integer that is a multiple of 16 at the K3 sizes the case stands for. Without it
the compile is what a launch with an unaligned value would give (measured 2026-12-07 on gfx950: the A16W4
grouped GEMM at 217 VGPRs unmarked against 82 as launched, the skinny GEMM with 65-90 SGPR spills unmarked and
none as launched). Token counts, head counts that vary with the tensor-parallel degree and the like stay plain.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from k3rocm.errors import HardwareError
from k3rocm.kernels import import_families

TARGETS = ("gfx950", "gfx942", "sm_90")

#: shared memory / LDS one program may use, bytes: gfx950 160 KiB, gfx942 64 KiB (CDNA3 ISA guide); sm_90 227 KiB
#: (CUDA programming guide, compute capability 9.0: 228 KiB per SM, 1 KiB reserved). A kernel that compiles
#: above it does not launch ("out of resource: shared memory").
LDS_LIMIT = {"gfx950": 160 * 1024, "gfx942": 64 * 1024, "sm_90": 227 * 1024}

_MATRIX_RE = {
    "hip": re.compile(r"\b(v_mfma\w*|v_smfmac\w*)"),
    "cuda": re.compile(r"\b(wgmma\.mma_async[\w.]*|mma\.sync[\w.]*)"),
}
_AMD_META = re.compile(
    r"\.(vgpr_count|sgpr_count|agpr_count|vgpr_spill_count|sgpr_spill_count|group_segment_fixed_size"
    r"|private_segment_fixed_size):\s+(\d+)")


@dataclass
class IsaReport:
    """What one kernel compiled to on one target.

    Attributes:
        name: kernel case name (family.kernel[variant]).
        target: ``gfx950``, ``gfx942`` or ``sm_90``.
        matrix_ops: sorted distinct matrix instructions found (empty when the kernel does no matrix work).
        vgpr, sgpr, agpr: register counts (AMD; ``None`` on CUDA — ptxas decides at load time).
        vgpr_spill, sgpr_spill: spill counts (AMD; ``None`` on CUDA).
        lds_bytes: static shared memory / LDS bytes requested by the kernel (``metadata.shared``).
        scratch_bytes: private (scratch) segment bytes per lane (AMD).
        num_warps: warps per program.
        error: compile error text, if compilation failed.
    """

    name: str
    target: str
    matrix_ops: list[str] = field(default_factory=list)
    vgpr: int | None = None
    sgpr: int | None = None
    agpr: int | None = None
    vgpr_spill: int | None = None
    sgpr_spill: int | None = None
    lds_bytes: int | None = None
    scratch_bytes: int | None = None
    num_warps: int | None = None
    expects_matrix: bool = False
    error: str | None = None
    asm: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        """No compile error, matrix instructions present where expected, shared memory / LDS within the target's
        limit (:data:`LDS_LIMIT`), no spills on AMD targets."""
        return not self.problems()

    def problems(self) -> list[str]:
        """Human-readable list of what is wrong (empty when :attr:`ok`)."""
        out = []
        if self.error:
            return [f"compile failed: {self.error.splitlines()[0] if self.error else ''}"]
        if self.expects_matrix and not self.matrix_ops:
            out.append("no matrix instructions (expected v_mfma/wgmma)")
        limit = LDS_LIMIT.get(self.target)
        if limit and self.lds_bytes and self.lds_bytes > limit:
            out.append(f"{self.lds_bytes} bytes of shared memory / LDS, above the {limit} a program may use "
                       f"on {self.target} (it would not launch)")
        if self.target.startswith("gfx"):
            if self.vgpr_spill:
                out.append(f"{self.vgpr_spill} VGPR spills")
            if self.sgpr_spill:
                out.append(f"{self.sgpr_spill} SGPR spills")
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("asm")
        d["ok"] = self.ok
        d["problems"] = self.problems()
        return d


#: suffix of an integer type in a case signature: "a multiple of 16 at run time" (module docstring)
ALIGNED_INT = ":16"


def specialize(signature: dict[str, str], values: dict[str, int]) -> dict[str, str]:
    """A copy of ``signature`` in which each integer argument named in ``values`` whose value is a multiple of 16
    gets the :data:`ALIGNED_INT` suffix, as the launcher would specialise it for that value (0 included).
    ``values``: the integer arguments at the K3 sizes the case stands for.

    Raises:
        HardwareError: a name in ``values`` that is not an integer argument of ``signature``.
    """
    out = dict(signature)
    for name, v in values.items():
        if out.get(name) not in ("i32", "i64"):
            raise HardwareError(f"ISA case: {name!r} is not an i32 / i64 argument of the signature ({out.get(name)!r})")
        if int(v) % 16 == 0:
            out[name] += ALIGNED_INT
    return out


def _no_specialize(jit) -> set[str]:
    """Names of the arguments the kernel's launcher never specialises (``do_not_specialize``)."""
    names = list(jit.arg_names)
    out = set()
    for d in getattr(jit, "do_not_specialize", None) or ():
        out.add(d if isinstance(d, str) else names[d])
    return out


def gpu_target(target: str):
    """``"gfx950"`` / ``"gfx942"`` / ``"sm_90"`` -> ``triton.backends.compiler.GPUTarget``.

    Raises:
        HardwareError: unknown target name.
    """
    if re.fullmatch(r"gfx[0-9a-f]{3,4}", target):
        return GPUTarget("hip", target, 64)
    m = re.fullmatch(r"sm_(\d+)", target)
    if m:
        return GPUTarget("cuda", int(m.group(1)), 32)
    raise HardwareError(f"unknown ISA target {target!r}; use one of {', '.join(TARGETS)}")


def compile_kernel(fn: Callable, signature: dict[str, str], constexprs: dict[str, Any], target: str,
                   name: str | None = None, options: dict[str, Any] | None = None,
                   expects_matrix: bool = False, aligned: bool | tuple[str, ...] = True) -> IsaReport:
    """Compile one ``@triton.jit`` kernel ahead of time for ``target`` and parse the result.

    Args:
        fn: the jitted kernel (an ``@triton.autotune`` wrapper is unwrapped to its function).
        signature: argument name -> Triton type (``"*bf16"``, ``"*fp32"``, ``"i32"``, ``"fp32"``,
            ``"constexpr"``); every argument of the kernel must appear. ``"i32:16"`` / ``"i64:16"``: an integer
            that is a multiple of 16 at run time (module docstring; :func:`specialize`); an argument in the
            kernel's ``do_not_specialize`` cannot carry it (the launcher never specialises it).
        constexprs: values of the constexpr arguments.
        target: ``gfx950``, ``gfx942`` or ``sm_90``.
        options: compile options (``num_warps``, ``num_stages``, ``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``).
        aligned: mark arguments 16-byte divisible (``tt.divisibility = 16``) as the launcher does at run
            time for torch allocations: ``True`` = every pointer argument, a tuple = those argument names
            (pointers and integers such as strides), ``False`` = none. Without it the compiler must assume
            byte alignment and emits scalar loads that never run on the hardware.

    Returns:
        IsaReport (``error`` set instead of raising when the compiler rejects the kernel).
    """
    jit = fn
    while hasattr(jit, "fn") and not hasattr(jit, "arg_names"):  # Autotuner / Heuristics wrappers
        jit = jit.fn
    tgt = gpu_target(target)
    names = list(jit.arg_names)
    rep = IsaReport(name=name or getattr(jit, "__name__", str(jit)), target=target, expects_matrix=expects_matrix)
    ints16 = [n for n, t in signature.items() if t.endswith(ALIGNED_INT)]
    wrong = sorted(set(ints16) & _no_specialize(jit))
    if wrong:
        rep.error = (f"ConfigError: {', '.join(wrong)} marked {ALIGNED_INT} but the kernel does not specialise "
                     f"{'it' if len(wrong) == 1 else 'them'} (do_not_specialize); drop the suffix in the case")
        return rep
    signature = {n: t[: -len(ALIGNED_INT)] if t.endswith(ALIGNED_INT) else t for n, t in signature.items()}
    if aligned is True:
        div = [n for n, t in signature.items() if t.startswith("*")]
    else:
        div = list(aligned or ())
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in dict.fromkeys(div + ints16) if n in names}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            k = triton.compile(ASTSource(fn=jit, signature=signature, constexprs=constexprs, attrs=attrs), target=tgt,
                               options=dict(options or {}))
    except Exception as e:  # compiler errors are data here: the report says which kernel failed where
        rep.error = f"{type(e).__name__}: {e}"
        return rep
    rep.lds_bytes = int(getattr(k.metadata, "shared", 0) or 0)
    rep.num_warps = int(getattr(k.metadata, "num_warps", 0) or 0)
    if tgt.backend == "hip":
        asm = k.asm["amdgcn"]
        rep.matrix_ops = sorted(set(_MATRIX_RE["hip"].findall(asm)))
        meta: dict[str, int] = {}
        for key, val in _AMD_META.findall(asm):
            meta.setdefault(key, int(val))  # first kernel symbol's metadata
        rep.vgpr = meta.get("vgpr_count")
        rep.sgpr = meta.get("sgpr_count")
        rep.agpr = meta.get("agpr_count")
        rep.vgpr_spill = meta.get("vgpr_spill_count", 0)
        rep.sgpr_spill = meta.get("sgpr_spill_count", 0)
        rep.scratch_bytes = meta.get("private_segment_fixed_size")
        rep.lds_bytes = max(rep.lds_bytes, meta.get("group_segment_fixed_size", 0))
    else:
        asm = k.asm["ptx"]
        rep.matrix_ops = sorted(set(_MATRIX_RE["cuda"].findall(asm)))
    rep.asm = asm
    return rep


def family_cases(families: tuple[str, ...] | None = None) -> list[tuple]:
    """Collect ``isa_cases()`` from every kernel family that defines it (normalised to 6-tuples)."""
    mods, _ = import_families(families)  # a family that fails to import has no cases
    cases = []
    for fam, mod in mods.items():
        get = getattr(mod, "isa_cases", None)
        if get is None:
            continue
        for case in get():
            if len(case) == 5:
                case = (*case, {})
            name, fn, sig, consts, expects, opts = case
            cases.append((f"{fam}.{name}", fn, sig, consts, expects, opts or {}))
    return cases


def run_isa(targets: tuple[str, ...] = TARGETS, families: tuple[str, ...] | None = None,
            progress: Callable[[str], None] | None = None) -> list[IsaReport]:
    """Compile every family's kernels for every target. Returns one :class:`IsaReport` per (kernel, target); a
    case whose options for a backend are ``None`` does not run on that backend and is not compiled for it."""
    out = []
    for name, fn, sig, consts, expects, opts in family_cases(families):
        for t in targets:
            backend = "hip" if t.startswith("gfx") else "cuda"
            if backend in opts and opts[backend] is None:
                continue
            if progress:
                progress(f"{name} -> {t}")
            o = dict(opts.get(backend, {}))
            out.append(compile_kernel(fn, sig, {**consts, **o.pop("constexprs", {})}, t, name=name, options=o,
                                      expects_matrix=expects))
    return out
