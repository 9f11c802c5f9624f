"""The adversarial suite: inputs a new user tried that went wrong (issue "Nothing silently wrong").

One test per case of ``../shared/reference/qa-cases-2026-12-03.md`` (named ``test_case_NN_...`` after
its row) and per behaviour the issue names, grouped by the class of check they exercise:

- ``test_inputs.py``: values checked where they enter (sampling, seeds, steps, lr, AQN sigmas, LoRA
  targets, skip lists, token ids, layer inputs), the same check for YAML, CLI, Python and widgets;
- ``test_nonfinite.py``: NaN/inf stopped at their source (weights, rewards, losses, gradients) and
  divergence said in the log;
- ``test_files.py``: checkpoints, adapters, run directories, exports (checked loaders, locks,
  permissions, disk full, interrupted writes);
- ``test_configs_data.py``: configs, JSON Lines, model sources, the MATH reward's time budget and
  the widgets' agreement with the trainer.
- ``test_data_r2.py`` (round 2, ``test_r2_NN_...`` after the rows of the 2026-12-04 trial): JSON
  Lines keys, a task's splits and ``data.eval_dataset``, reward checks shared by training and evaluation.
- ``test_files_r2.py`` (round 2, rows of the 2026-12-04 trial): the values inside ``trainer_state.pt``
  and ``adapter_config.json`` checked at load, integer adapter tensors, ``attach_lora``'s arguments.
- ``test_aqn_widgets_r2.py`` (round 2, rows 27-29, 8, 10 of the 2026-12-04 trial): AQN schedule values
  set after construction, ``AQNPanel.set`` and the dashboard's sigma control checked by AQN's rules,
  and the causes a non-finite loss or logits list when the weights are finite.
- ``test_inputs_r2.py`` (round 2, rows of the QA trial of 2026-12-04, ``test_r2_NN_...``): YAML read
  strictly (duplicate keys, syntax errors, huge ints), finite values that cannot work (tiny lr and
  max_grad_norm, huge weight decay/beta/penalty/alpha/mu/batch/data sizes), steps past total_steps at
  lr 0, seeds from Python, ``qerl eval``/``quantize`` flags checked before loading.
- ``test_aqn_r3.py`` (round 3, rows 17, 23, 25, 26 of the third trial, 2026-12-04, ``test_r3_NN_...``):
  AQN steps by one rule (``aqn.check_step``), the panel's probe result, the dashboard's metrics and
  redraw interval, ``arith.make_dataset``'s ``n`` and levels.
- ``test_tasks_r3.py`` (round 3, rows 13-16, 18-22 of the third trial of 2026-12-04, ``test_r3_NN_...``):
  a ``Task``'s rows, rewards and ``max_new_tokens`` checked when it is made, every engine's
  ``stop_token_ids``, ``evaluate``'s seed and dataset, ``EvalResult.by``/``example_rows``.
- ``test_env_r3.py`` (round 3, rows 11, 12, 24, 27-29 of the third trial, 2026-12-04, ``test_r3_NN_...``):
  ``plan_memory``'s and ``kernel_report``'s arguments, the grid's flags as usage errors, ``QERL_THREADS``
  and ``QERL_DATA``.
- ``test_export_r3.py`` (round 3, rows 1-10 of the third trial, 2026-12-04, ``test_r3_NN_...``):
  ``save_nvfp4``'s dtype and shard size, ``load_nvfp4``'s checked reads (NaN tensors, config.json,
  truncated files), exports that ``qerl eval`` runs, model directories without a tokenizer, ``--skip``.

Every test here failed on main before the issue's fixes (fe1b96e).
"""
