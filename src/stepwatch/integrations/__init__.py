"""Bridges: stepwatch's callbacks inside other trainers.

One module per trainer, each with a ``StepwatchCallback`` written in that trainer's own
callback API. It takes a list of stepwatch callbacks (built-in ones or your own MindSpore-style
``Callback``) and runs them inside the host's training: they get the same ``cb_params`` and
``RunContext`` as under ``stepwatch.Model``, and their actions reach the host's controls.

======================================  ==================================  ===================
module                                  host callback                       extra
======================================  ==================================  ===================
``stepwatch.integrations.mindspore``    ``mindspore.train.Callback``        ``[mindspore]``
``stepwatch.integrations.lightning``    ``lightning.pytorch.Callback``      ``[lightning]``
``stepwatch.integrations.transformers`` ``transformers.TrainerCallback``    ``[transformers]``
``stepwatch.integrations.keras``        ``keras.callbacks.Callback``        ``[keras]``
======================================  ==================================  ===================

This package imports nothing by itself: each module imports its host when it is imported.
"""
