"""qerl_kit: notebook-first quantization-enhanced RL (QeRL) for LLMs.

Import is cheap on purpose: submodules (``qerl_kit.nvfp4``, ``qerl_kit.quantize`` ...) are imported
by the caller, so ``import qerl_kit`` never pulls in transformers or peft.
"""

__version__ = "0.1.0"
