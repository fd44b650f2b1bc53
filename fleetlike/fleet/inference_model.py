"""``fleet.save_inference_model`` and its loader: the one checkpoint file that needs pickle.

The directory holds ``state_dict.pt`` (the weights: tensors only), ``served.pt`` (TorchScript
in eval mode, for a model server with neither fleetlike nor the model's code), ``model.pt``
(the whole module pickled, as Paddle's ``load_inference_model`` returns a runnable program) and
``inference.json``, sealed with checksums like a training checkpoint
(`fleetlike.fleet.checkpoint_files`).

Unpickling ``model.pt`` imports and runs code named in the file: whoever could write the
directory could run code in the loading process. So `load_inference_model` reads only the
weights by default: give it the model to fill (``model=``), or opt in to the pickle with
``weights_only=False`` for a directory you trust, as ``torch.load`` asks.

Example:
    >>> fleet.save_inference_model(exe, "inf", ["x"], ["logits"])
    >>> model, feeds, targets = load_inference_model("inf", model=Net())     # weights only
    >>> model, feeds, targets = load_inference_model("inf", weights_only=False)  # trusted: unpickles
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from fleetlike.fleet.checkpoint_files import (
    FORMAT,
    CheckpointError,
    atomic_dir,
    read_json,
    resolve,
    verify,
    write_json,
)
from fleetlike.strategies.recompute import plain_forwards

__all__ = ["SERVED_FILE", "load_inference_model", "save_inference_model"]

#: ``save_inference_model``'s served model: TorchScript in eval mode, loadable by a plain PyTorch
#: process (``torch.jit.load(dirname + "/served.pt")``) that imports neither fleetlike nor the
#: model's code, as a model server does.
SERVED_FILE = "served.pt"

log = logging.getLogger("fleetlike")


def _script_for_serving(model: torch.nn.Module) -> tuple[Any, str | None]:
    """``(TorchScript module in eval mode, None)``, or ``(None, why not)``."""
    try:
        scripted = torch.jit.script(model)
    except Exception as exc:  # TorchScript rejects many Python constructs; say which and go on
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc}"
    scripted.eval()
    return scripted, None


def save_inference_model(dirname: str | os.PathLike[str], model: torch.nn.Module,
                         feeded_var_names: list[str], target_vars: list[str], served: bool = True) -> None:
    """Write the model for inference; with ``served`` also `SERVED_FILE` (TorchScript, eval mode).

    A model TorchScript cannot compile still gets ``model.pt`` and ``state_dict.pt``; the reason
    is logged and kept in ``inference.json`` (``served_error``)."""
    with plain_forwards(model):  # recompute's wrappers are training machinery, not the model
        _write_inference(dirname, model, feeded_var_names, target_vars, served)


def _write_inference(dirname: str | os.PathLike[str], model: torch.nn.Module, feeded_var_names: list[str],
                     target_vars: list[str], served: bool) -> None:
    scripted, why = _script_for_serving(model) if served else (None, None)
    if why is not None:
        log.warning("fleet.save_inference_model: no %s (the model does not compile to TorchScript: %s); "
                    "model.pt and state_dict.pt are written, which need the model's code to load. Make the "
                    "model scriptable, or pass export_for_deployment=False to skip this", SERVED_FILE, why)
    with atomic_dir(dirname) as tmp:
        torch.save(model, tmp / "model.pt")
        torch.save(model.state_dict(), tmp / "state_dict.pt")
        if scripted is not None:
            torch.jit.save(scripted, str(tmp / SERVED_FILE))
        write_json(tmp / "inference.json", {
            "format": FORMAT,
            "feeded_var_names": list(feeded_var_names),
            "target_vars": list(target_vars),
            "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
            "served": SERVED_FILE if scripted is not None else None,
            "served_error": why,
        })


def load_inference_model(dirname: str | os.PathLike[str], model: torch.nn.Module | None = None, *,
                         weights_only: bool = True) -> tuple[torch.nn.Module, list[str], list[str]]:
    """Load what ``fleet.save_inference_model`` wrote: ``(model in eval mode, feeds, targets)``.

    With ``model``, its weights are loaded from ``state_dict.pt`` (``torch.load(weights_only=True)``:
    no code from the directory runs). Without it, the pickled module ``model.pt`` is loaded, which
    imports and runs whatever code the file names: only with ``weights_only=False``, for a
    directory whose writers you trust (as ``torch.load(weights_only=False)``)."""
    path = resolve(dirname)
    verify(path)
    meta = read_json(path / "inference.json")
    if not isinstance(meta, dict) or "feeded_var_names" not in meta or "target_vars" not in meta:
        raise CheckpointError(f"{path / 'inference.json'} lacks 'feeded_var_names' or 'target_vars': it was "
                              "edited or damaged; save the inference model again")
    if model is not None:
        try:
            weights = torch.load(path / "state_dict.pt", map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - named with its file
            raise CheckpointError(f"{path / 'state_dict.pt'} could not be read ({type(exc).__name__}: "
                                  f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc})") from exc
        model.load_state_dict(weights)
    elif weights_only:
        raise CheckpointError(
            f"{path / 'model.pt'} is a pickled module: loading it runs code named in the file. Pass the model "
            f"to fill, load_inference_model({str(dirname)!r}, model=YourModel(...)), which reads only the weights, "
            "or weights_only=False if you trust whoever could write this directory"
        )
    else:
        model = torch.load(path / "model.pt", weights_only=False)
    model.eval()
    return model, meta["feeded_var_names"], meta["target_vars"]
