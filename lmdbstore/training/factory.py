"""The user's own model: a factory named ``module:function`` or ``path/to/file.py:function``, loaded, called and
guarded so that whatever it does wrong is one :class:`~lmdbstore.errors.ModelError` line naming it.

A factory is called as ``factory(in_shape, classes, **model_args)``: ``in_shape`` is one sample as the loader
feeds it (``(C, H, W)``; ``(H, W)`` gets ``C = 1``, ``(L,)`` is ``(1, L)``); it returns an ``nn.Module`` mapping
a float32 batch ``(N, *in_shape)`` (channels-last in memory for images) to ``(N, classes)`` logits.

A checkpoint records the factory as its *identity* (the module's last name or the file's stem, and the function:
``my_cnn:build`` for ``examples/my_cnn.py:build`` and ``pkg.my_cnn:build``) and its arguments as JSON; never code.
``eval`` and ``--resume`` rebuild the model only from a factory the caller names, and refuse one whose identity
or arguments differ.  Module references are imported with the current directory on ``sys.path`` meanwhile.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmdbstore.config import BUILTIN_MODEL
from lmdbstore.errors import LmdbStoreError, ModelError, one_line

__all__ = ["ModelRef", "build_from", "call_model", "feed_shape", "load_factory", "model_ref"]


@dataclass(frozen=True)
class ModelRef:
    """A parsed factory reference ``text``: its ``function``, and its ``module`` (dotted name) or ``file`` (the
    ``.py`` file, resolved)."""

    text: str
    function: str
    module: str | None
    file: Path | None

    @property
    def identity(self) -> str:
        """What a checkpoint records and compares: ``<module's last name or file stem>:<function>``."""
        base = self.file.stem if self.file is not None else (self.module or "").rpartition(".")[2]
        return f"{base}:{self.function}"

    @property
    def builtin(self) -> bool:
        """Whether this is the built-in CNN."""
        return self.text == BUILTIN_MODEL


def model_ref(text: str) -> ModelRef:
    """Parse ``module:function`` or ``path/to/file.py:function`` (a path: it ends in ``.py`` or holds a ``/``).

    Raises:
        ValueError: naming ``model``, for text of neither form.
    """
    target, sep, function = str(text).rpartition(":")
    if not sep or not target or not function.isidentifier():
        raise ValueError(f"model must be 'module:function' or 'path/to/file.py:function', got {text!r}")
    if target.endswith(".py") or "/" in target or "\\" in target:
        return ModelRef(str(text), function, None, Path(target).expanduser().resolve())
    if not all(part.isidentifier() for part in target.split(".")):
        raise ValueError(f"model must be 'module:function' or 'path/to/file.py:function', got {text!r}")
    return ModelRef(str(text), function, target, None)


def _import_module(ref: ModelRef) -> Any:
    """The factory's module: imported with the current directory on ``sys.path`` meanwhile, or loaded from its
    file under a name of its own (registered in ``sys.modules``, as any import is: pickling its classes works).

    Raises:
        ModelError: no such module or file, or importing it raised (one line).
    """
    if ref.file is None:
        assert ref.module is not None
        added = "" not in sys.path and str(Path.cwd()) not in sys.path
        if added:
            sys.path.insert(0, str(Path.cwd()))
        try:
            return importlib.import_module(ref.module)
        except Exception as exc:
            raise ModelError(f"cannot import model module {ref.module!r} ({one_line(exc)})", path=ref.text) from exc
        finally:
            if added and str(Path.cwd()) in sys.path:
                sys.path.remove(str(Path.cwd()))
    if not ref.file.is_file():
        raise ModelError("no such model file", path=ref.file)
    name = f"lmdbstore_model_{ref.file.stem}_{hashlib.sha256(str(ref.file).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ref.file)
    if spec is None or spec.loader is None:
        raise ModelError("cannot load the model file as Python", path=ref.file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ModelError(f"loading the model file raised {one_line(exc)}", path=ref.file) from exc
    return module


def load_factory(ref: ModelRef) -> Callable[..., Any]:
    """The factory function ``ref`` names.

    Raises:
        ModelError: its module cannot be imported, or has no such callable.
    """
    module = _import_module(ref)
    fn = getattr(module, ref.function, None)
    if not callable(fn):
        raise ModelError(f"the model module has no function {ref.function!r}", path=ref.text)
    return fn  # type: ignore[no-any-return]


def feed_shape(sample_shape: tuple[int, ...]) -> tuple[int, ...]:
    """One sample as the loader feeds it: a channel axis added in front of samples of fewer than 3 dimensions."""
    shape = tuple(int(s) for s in sample_shape)
    return (1, *shape) if len(shape) < 3 else shape


def build_from(ref: ModelRef, in_shape: tuple[int, ...], classes: int, kwargs: dict[str, Any]) -> nn.Module:
    """``factory(in_shape, classes, **kwargs)``, checked to be an ``nn.Module``.

    Raises:
        ModelError: the factory cannot be loaded, raises, or returns something else than an ``nn.Module``.
        ValueError: the built-in CNN refuses the shape or its arguments (its own one-line messages).
    """
    fn = load_factory(ref)
    # the built-in CNN's own ValueErrors are one-line messages already
    ours: tuple[type[Exception], ...] = (LmdbStoreError, ValueError) if ref.builtin else (LmdbStoreError,)
    try:
        model = fn(tuple(in_shape), int(classes), **kwargs)
    except ours:
        raise
    except Exception as exc:
        args = json.dumps(kwargs, sort_keys=True)
        raise ModelError(
            f"model factory raised {one_line(exc)} (called with in_shape {tuple(in_shape)}, classes {classes}, "
            f"model_args {args})",
            path=ref.text,
        ) from exc
    if not isinstance(model, nn.Module):
        raise ModelError(f"model factory returned a {type(model).__name__}, not a torch.nn.Module", path=ref.text)
    return model


def call_model(net: nn.Module, x: torch.Tensor, classes: int, ref: str) -> torch.Tensor:
    """``net(x)``, checked to be ``(N, classes)`` logits; a model raising in ``forward`` is one line naming
    its factory ``ref`` (not a traceback through the trainer).

    Raises:
        ModelError: ``forward`` raised, or returned something else than ``(N, classes)`` logits.
    """
    try:
        out = net(x)
    except LmdbStoreError:
        raise
    except Exception as exc:
        if type(exc).__module__.startswith(("torch._dynamo", "torch._inductor")):
            raise ModelError(
                f"torch.compile failed: {one_line(exc)}", path=ref, hint="train without compile=True"
            ) from exc
        raise ModelError(
            f"the model raised in forward on a batch of shape {tuple(x.shape)}: {one_line(exc)}", path=ref
        ) from exc
    want = (x.shape[0], classes)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
        raise ModelError(
            f"the model returned {got} for a batch of shape {tuple(x.shape)}; logits of shape {want} expected",
            path=ref,
        )
    return out
