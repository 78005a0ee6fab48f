"""Images in prompts: what a prepared request carries for each (inputs.py), how an image becomes those
inputs (images.py: the checkpoint's processor, content hashes), and where images come from (media.py: data,
http(s) and file URLs within the limits an app sets)."""
