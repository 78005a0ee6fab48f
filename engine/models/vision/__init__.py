"""Vision towers of vision-language models: images in, one embedding per patch out."""
