#!/usr/bin/env python
"""Fine-tune a Mistral-style model with fa_amd attention through Accelerate.

    accelerate launch recipes/finetune_mistral.py            # defaults: no download needed
    accelerate launch recipes/finetune_mistral.py --help     # every option

The training code is shared with the other recipes (finetune_common.py);
docs/RECIPES.md describes options, configs and multi-node launch.
"""
import os
import sys

# Run as a script (accelerate launch recipes/finetune_mistral.py): make the
# sibling modules importable whatever the working directory is.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from finetune_options import check_options_early  # noqa: E402

if __name__ == "__main__":
    # --help and bad options answer at once, before torch and transformers are imported.
    check_options_early("mistral")
    from finetune_common import main

    main(model_type="mistral")
