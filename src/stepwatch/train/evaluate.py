"""The evaluation pass: ``Model.eval`` and the validation inside ``fit``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..dataset import check_batch, dataset_size, feed, move
from ..monitor import values as names
from .callback._callback import CallbackList, CallbackParams, RunContext
from .eval_indexes import called_with, eval_inputs, pick_outputs
from .parallel import extra_forwards, reduce_epoch
from .parts import LOSS_CHUNK, Parts, evaluate_metric, fold_losses
from .step import cast_floats

__all__ = ["eval_in_fit", "eval_pass"]


def eval_in_fit(
    parts: Parts,
    valid_dataset: Iterable[Any],
    cb_list: CallbackList,
    cb_params: CallbackParams,
    run_context: RunContext,
    metric_names: list[str],
) -> None:
    """Validate inside ``fit``: the same cb_params, switched to the evaluation and back."""
    batch_num = dataset_size(valid_dataset, "valid_dataset")
    with cb_params.evaluating(batch_num, hide=metric_names):
        eval_pass(parts, valid_dataset, batch_num, cb_list, cb_params, run_context)


def eval_pass(
    parts: Parts,
    dataset: Iterable[Any],
    batch_num: int,
    cb_list: CallbackList,
    cb_params: CallbackParams,
    run_context: RunContext,
    stoppable: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Evaluate the metrics on ``dataset``; return ``(metrics, eval_results)``.

    ``stoppable`` (``Model.eval``): a stop a callback requests ends the pass after that step
    (``OnRequestExit`` on a signal), as in MindSpore. Inside ``fit`` the pass always runs whole:
    a stop requested during training must not cut the epoch's validation short.

    From ``on_eval_epoch_end`` on, cb_params shows this pass's own values: each metric as an
    attribute and ``loss`` as the pass's mean loss; ``eval_results`` (the metrics plus
    ``eval_loss``) is set before ``on_eval_end``. In a distributed run the metrics and the
    loss are those of all ranks' batches together (reduced in one collective).
    """
    network = parts.eval_network
    loss_fn, device = parts.loss_fn, parts.device
    indexes = parts.eval_indexes
    amp = parts.step.autocast(device)
    cast = parts.step.precision.dtype if parts.step.precision.cast_network else None
    cb_params.mode = "eval"
    cb_params.valid_dataset = dataset
    cb_params.batch_num = batch_num
    step_begin = cb_list.table["on_eval_step_begin"]
    step_end = cb_list.table["on_eval_step_end"]
    call = cb_list.call
    metric_items = list(parts.metrics.values())
    for metric in metric_items:
        metric.clear()
    pending: list[torch.Tensor] = []
    total: torch.Tensor | None = None
    steps = 0
    # A sharded network: every rank runs as many forwards (each gathers the parameters).
    extra = extra_forwards(network, batch_num) if cb_params.device_number > 1 else 0
    data: Any = None
    inputs: Any = None
    was_training = network.training
    network.eval()
    try:
        call("on_eval_begin", run_context)
        call("on_eval_epoch_begin", run_context)
        with torch.no_grad():
            for batch in dataset:
                steps += 1
                cb_params.cur_step_num = steps
                cb_params.eval_dataset_element = batch
                if step_begin:
                    call("on_eval_step_begin", run_context)
                if indexes is None:
                    try:
                        data, label = batch
                    except (TypeError, ValueError):
                        check_batch(batch, "valid_dataset", loss_fn is not None)
                        raise
                    data, label = move(data, device), move(label, device)
                    if cast is not None:
                        data = cast_floats(data, cast)
                    with amp:
                        outputs = feed(network, data)
                        loss = loss_fn(outputs, label) if loss_fn is not None else None
                else:  # MindSpore's eval network: the whole batch in, a tuple out
                    inputs = move(eval_inputs(batch), device)
                    if cast is not None:
                        inputs = cast_floats(inputs, cast)
                    with amp:
                        try:
                            returned = network(*inputs)
                        except TypeError as exc:
                            exc.add_note(called_with(network, inputs))
                            raise
                    loss, outputs, label = pick_outputs(returned, indexes)
                    cb_params._eval_returned = returned
                for metric in metric_items:
                    if getattr(metric, "uses_loss", False):
                        if loss is not None:
                            metric.update(loss)
                    else:
                        metric.update(outputs, label)
                if loss is not None:
                    pending.append(loss)
                    if len(pending) == LOSS_CHUNK:
                        total = fold_losses(total, pending)
                cb_params.loss_tensor = loss
                cb_params.outputs = outputs  # computed under no_grad: no graph
                cb_params._eval_label = label if loss is not None else None
                if step_end:
                    call("on_eval_step_end", run_context)
                if stoppable and run_context.stop_requested:
                    break
            if extra and steps == batch_num:
                with amp:  # the last batch again: joins the other ranks' gathers, not counted
                    for _ in range(extra):
                        feed(network, data) if indexes is None else network(*inputs)
        total = fold_losses(total, pending)
        loss_sum = float(total) if total is not None and steps else None
        if cb_params.device_number > 1:
            # One collective: the loss, the step count and the metrics' states of all ranks.
            summed, steps = reduce_epoch(total, steps, metric_items)
            loss_sum = summed if (loss_fn is not None or indexes is not None) and steps else None
        metrics = {name: evaluate_metric(name, m) for name, m in parts.metrics.items()}
        results = dict(metrics)
        cb_params.metrics = metrics  # from here on the values, as MindSpore has them
        if loss_sum is not None:
            results[names.EVAL_LOSS] = loss_sum / steps
        for name, value in metrics.items():
            if name != "loss":
                setattr(cb_params, name, value)
        cb_params.loss = results.get(names.EVAL_LOSS)
        call("on_eval_epoch_end", run_context)
        cb_params.eval_results = results
        call("on_eval_end", run_context)
    finally:
        network.train(was_training)
        cb_params._eval_label = cb_params._eval_returned = None  # nothing kept after the pass
    return metrics, results
