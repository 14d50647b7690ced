"""What makes fusedpar's ops visible to ``torch.compile``: the ``torch.library`` namespace, the
names that stand for transports and groups in an op's schema, and the placeholder of a tensor an
op does not produce.

Every differentiable fusedpar op is a ``torch.library.custom_op`` in the ``fusedpar`` namespace
(``torch.ops.fusedpar.<name>``) with a fake (meta) implementation that computes the output shapes
without running anything and a ``register_autograd`` backward that calls the op's ``*_backward``
custom op (``gather_features`` / ``scatter_features`` are each other's backward, ``all_to_all_v``
is its own with the splits swapped, ``attach_aux_loss``'s backward is closed-form). The
compiler (Dynamo, AOTAutograd, Inductor) treats each op as one opaque node, so a block with
fusedpar ops traces without a graph break and its backward graph calls the same kernels as eager
mode: eager and compiled runs take the same code path.

**Transports and groups in a schema.** A schema holds tensors, numbers, strings and dtypes, not
Python objects. The functional API therefore passes a *transport token*: a string that the op
resolves back to its :class:`~fusedpar.ops.transport.Transport` when it runs
(:func:`transport_token` / :func:`resolve_token`):

* ``"<name>@<group name>"`` for a transport chosen by name (``"portable"``, ``"symmetric"``,
  ``"auto"``, or empty for the op's default) over a process group (``group.group_name``; empty
  for the default group). Dynamo reads ``group.group_name`` as a constant, so the token is a
  constant of the graph.
* ``"object:<n>"`` for a :class:`Transport` instance (each registers itself when it is built,
  weakly: a token outlives its transport only as a dangling name, which raises a clear error).

**Defining an op.** Every op is defined in a ``fusedpar/ops/<family>_library.py`` module with
:func:`custom_op` (the namespace is written only here) and bound to a public module-level name
(``rms_norm_op``) that the functional API calls; a registered backward returns
:func:`input_grads` (one entry per argument of the forward's schema, ``None`` where not given).

**Absent tensors.** A custom op cannot return ``None``: an output an op does not produce (a
gradient nobody asked for, a residual not kept) is a 0-element tensor, :func:`absent`, mapped
back to ``None`` by :func:`present`.

**Argument errors under torch.compile.** Every functional API is wrapped in :func:`checked_api`:
in eager mode it changes nothing; while Dynamo traces, a ``TypeError`` / ``ValueError`` raised by
the API's checks would reach the user (``fullgraph=True``) as Dynamo's ``Unsupported: Observed
exception`` with the real error buried in a debug line, so the wrapper catches it and raises it
again from outside the traced code as :class:`CheckTypeError` / :class:`CheckValueError`: a
subclass of the same built-in type with the same message (Dynamo lets its ``Unsupported`` family
through unwrapped; the traced user code that made the call is attached as a note).
"""
from __future__ import annotations

import functools
import itertools
import traceback
import weakref

import torch
import torch.distributed as dist
from torch._dynamo.exc import Unsupported

__all__ = ["NAMESPACE", "custom_op", "input_grads", "absent", "present", "register_transport", "transport_token",
           "transport_size", "resolve_token", "token_group", "token_size", "hold", "checked_api", "CheckTypeError",
           "CheckValueError"]

#: the ``torch.library`` namespace of every fusedpar op: ``torch.ops.fusedpar.<name>``
NAMESPACE = "fusedpar"


def custom_op(name: str, *, mutates_args=()):
    """``torch.library.custom_op`` in the fusedpar namespace: ``custom_op("rms_norm")`` defines
    ``fusedpar::rms_norm`` (``torch.ops.fusedpar.rms_norm``). Used as a decorator, or called on a
    named body: ``rms_norm_op = custom_op("rms_norm")(rms_norm_fwd)``."""
    return torch.library.custom_op(f"{NAMESPACE}::{name}", mutates_args=mutates_args)


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


_OBJECT_PREFIX = "object:"
_objects: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()
_counter = itertools.count()


def register_transport(transport) -> str:
    """A fresh token naming ``transport`` (held weakly); called once by every Transport's constructor."""
    token = f"{_OBJECT_PREFIX}{next(_counter)}"
    _objects[token] = transport
    return token


def transport_token(transport, group) -> str:
    """The string an op's schema carries for ``transport=`` / ``group=`` (see the module
    docstring). Pure Python on constants: Dynamo folds it into the graph. Raises the same
    ``ValueError`` as the transports for a Transport instance passed together with a group."""
    if isinstance(transport, str) or transport is None:
        name = "" if transport is None else transport
        return f"{name}@{'' if group is None else group.group_name}"
    token = getattr(transport, "token", None)
    if not isinstance(token, str):
        raise TypeError(f"transport must be None, a transport name or a fusedpar.ops.transport.Transport, "
                        f"got {type(transport).__name__}")
    if group is not None:
        raise ValueError("pass either group= or a Transport instance as transport=, not both "
                         f"(got group={group!r} and transport={transport!r})")
    return token


def transport_size(transport, group) -> int:
    """The group size an op will run on, from its ``transport=`` / ``group=`` arguments without
    building the transport (Dynamo folds ``dist.get_world_size`` into a constant)."""
    if transport is not None and not isinstance(transport, str):
        return transport.size
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def token_group(token: str):
    """The process group a name token names (``None``: the default group)."""
    name = token.rpartition("@")[2]
    if not name:
        return None
    # torch's own registry of group names (what its functional collectives resolve names with)
    return dist.distributed_c10d._resolve_process_group(name)


def resolve_token(token: str):
    """``(transport, group)`` for a token: a registered Transport instance and ``None``, or the
    transport name (``None`` for the op's default) and the process group it names."""
    if token.startswith(_OBJECT_PREFIX):
        transport = _objects.get(token)
        if transport is None:
            raise ValueError(f"transport token {token!r} names a Transport that no longer exists")
        return transport, None
    name = token.rpartition("@")[0]
    return (name or None), token_group(token)


def token_size(token: str) -> int:
    """The group size a token names, without building a transport (what the fakes need)."""
    return transport_size(*resolve_token(token))


def hold(*tokens) -> tuple:
    """What a backward's context keeps for the tokens it will use (``None`` entries skipped): a
    Transport made for one call (``transport=EmulatedTransport(2)``) is named by its token only
    weakly, so the context holds it until the backward has run."""
    return tuple(resolve_token(t)[0] for t in tokens if t is not None)


def absent(like: torch.Tensor) -> torch.Tensor:
    """The placeholder of a tensor an op does not produce: 0 elements, ``like``'s dtype and device."""
    return like.new_empty((0,))


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
