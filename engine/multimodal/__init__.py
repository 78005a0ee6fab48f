"""Images in prompts: what a prepared request carries for each (engine/multimodal/inputs.py) and how an
image becomes those inputs (engine/multimodal/images.py)."""
