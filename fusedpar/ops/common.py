"""What makes fusedpar's ops visible to ``torch.compile``, shared by every family.

Every differentiable fusedpar op is a ``torch.library.custom_op`` in the ``fusedpar`` namespace,
defined with :func:`custom_op` (the one place the namespace is written), with a fake that computes
the output shapes without running anything and a ``register_autograd`` backward that calls the
op's ``*_backward`` op; the compiler treats each op as one opaque node, so eager and compiled
modes run the same kernels. :func:`input_grads` fills a backward's ``None`` returns from the
forward op's schema; :func:`absent` / :func:`or_absent` / :func:`present` stand for tensors an op
does not produce; :class:`CheckValueError` / :class:`CheckTypeError` and :func:`checked_api` make
an API's argument errors reach the caller unchanged under ``torch.compile(fullgraph=True)``;
:func:`call_op` runs a forward op's body without the dispatcher in plain eager mode."""
from __future__ import annotations

import functools
import traceback

import torch
from torch._dynamo.exc import Unsupported

#: the ``torch.library`` namespace of every fusedpar op: ``torch.ops.fusedpar.<name>``
NAMESPACE = "fusedpar"


def custom_op(name: str, *, mutates_args=()):
    """``torch.library.custom_op`` in the fusedpar namespace: ``custom_op("rms_norm")`` defines
    ``fusedpar::rms_norm`` (``torch.ops.fusedpar.rms_norm``). Used as a decorator, or called on a
    named body: ``rms_norm_op = custom_op("rms_norm")(rms_norm_fwd)``."""
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=mutates_args)


#: tensor types the eager path takes (a subclass, FakeTensor, DTensor, ..., dispatches)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_no_functorch = torch._C._functorch.peek_interpreter_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_profiling = torch._C._autograd._profiler_enabled
_jit_tracing = torch._C._get_tracing_state


def plain_eager(args) -> bool:
    """Whether a call of an op with ``args`` may skip torch's dispatcher (:func:`call_op`): not
    traced by ``torch.compile`` or ``torch.jit.trace``, no torch-dispatch or torch-function mode
    (fake tensors, functionalisation, tracing, selective checkpointing, debug modes), no functorch
    transform, no profiler (its trace names the op), every tensor a plain ``Tensor`` /
    ``Parameter`` and not on the meta device (the op's fake answers for it)."""
    if (torch.compiler.is_compiling() or _dispatch_modes() or _function_modes() or _no_functorch() is not None
            or _profiling() or _jit_tracing() is not None):
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) not in _PLAIN_TENSORS or a.is_meta):
            return False
    return True


@functools.lru_cache(maxsize=None)
def _eager_function(op):
    """The ``torch.autograd.Function`` of ``op``'s eager path, or None where ``op`` does not hold
    what it needs (its body, ``register_autograd``'s backward and setup_context) or has a kernel
    per device type or an autocast rule (made once per op: fusedpar registers its ops at import)."""
    body, backward, setup = (getattr(op, n, None) for n in ("_init_fn", "_backward_fn", "_setup_context_fn"))
    if body is None or backward is None or setup is None or set(getattr(op, "_backend_fns", {None: 0})) != {None}:
        return None  # (a kernel registered for a device type would run there instead of the body)
    if getattr(op, "_autocast_dtype", None):
        return None  # (an autocast rule casts the inputs on the dispatcher's way)

    def forward(ctx, *args):
        out = body(*args)
        setup(ctx=ctx, inputs=args, output=out)
        return out

    return type(f"Eager_{NAMESPACE}_{op._name}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def call_op(op, *args):
    """``op(*args)`` for a forward op defined with :func:`custom_op` and ``register_autograd``
    (positional arguments, every one given, so setup_context sees them as torch would; a body that
    returns fresh tensors, as torch requires): through torch's dispatcher, or, in plain eager mode
    (:func:`plain_eager`), straight to its body -- under an ``autograd.Function`` made of the
    same backward and setup_context when an input requires grad -- which skips the dispatcher's
    ~10 us and the ~40 us of its autograd wrapper per call (it rebuilds the schema's defaults).
    The same body, the same saved tensors and backward: results and gradients are the op's."""
    if not plain_eager(args):
        return op(*args)
    fn = _eager_function(op)
    if fn is None:
        return op(*args)
    if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
        return fn.apply(*args)
    return op._init_fn(*args)


@functools.lru_cache(maxsize=None)
def _argument_names(op) -> tuple:
    return tuple(a.name for a in op._opoverload._schema.arguments)


def input_grads(op, **grads) -> tuple:
    """What a ``register_autograd`` backward of ``op`` returns: one entry per argument of its
    schema, in order, ``grads[name]`` for the named arguments and ``None`` for the rest.
    ``input_grads(rms_norm_op, x=dx, weight=dw)`` -> ``(dx, dw, None, None)``. Raises
    ``ValueError`` for a name that is not an argument of ``op``."""
    names = _argument_names(op)
    unknown = sorted(set(grads) - set(names))
    if unknown:
        raise ValueError(f"input_grads: {op._name} has no argument {', '.join(unknown)} (its arguments: "
                         f"{', '.join(names)})")
    return tuple(grads.get(n) for n in names)


def absent(like: torch.Tensor) -> torch.Tensor:
    """The placeholder of a tensor an op does not produce: 0 elements, ``like``'s dtype and device."""
    return like.new_empty((0,))


def or_absent(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``t``, or :func:`absent`'s placeholder (``like``'s dtype and device) for ``None``: what an op
    returns for an output it may not produce."""
    return absent(like) if t is None else t


def present(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t``, or ``None`` for :func:`absent`'s placeholder."""
    return None if t is None or t.numel() == 0 and t.dim() == 1 else t


class _CheckErrorMixin:
    """What the two compiled-check errors share: ``str()`` is the check's own message (Dynamo
    appends the traced user code to an error's text; it is kept as a note instead)."""

    def __init__(self, message: str):
        Unsupported.__init__(self, message)
        self.message = message
        frames = "".join(traceback.format_list(list(self.real_stack or [])[:-1]))  # [-1]: checked_api itself
        if frames:
            self.add_note(f"raised while torch.compile traced:\n{frames}")

    def __str__(self) -> str:
        return self.message


class CheckTypeError(_CheckErrorMixin, TypeError, Unsupported):
    """A ``TypeError`` of an op's argument checks, raised while ``torch.compile`` traced the call."""


class CheckValueError(_CheckErrorMixin, ValueError, Unsupported):
    """A ``ValueError`` of an op's argument checks, raised while ``torch.compile`` traced the call."""


@torch._dynamo.assume_constant_result
def _raise_traced(kind: str, message: str):
    # called by Dynamo, not traced: the error leaves the compiler as itself (module docstring)
    raise (CheckTypeError if kind == "TypeError" else CheckValueError)(message)


def checked_api(fn):
    """Decorator of a functional API: its ``TypeError`` / ``ValueError`` reaches the caller with
    its type and message under ``torch.compile(fullgraph=True)`` too (module docstring)."""

    @functools.wraps(fn)
    def api(*args, **kwargs):
        if not torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except (TypeError, ValueError) as e:
            _raise_traced("TypeError" if isinstance(e, TypeError) else "ValueError", str(e))
            raise

    return api
