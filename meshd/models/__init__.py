"""Models: built-in ones, published shapes, GGUF files, and the files peers share by compat key."""

# the built-in models' names, importable without torch (meshctl's argument parser needs them);
# meshd.models.builtin defines each and checks it defines exactly these
BUILTIN_NAMES = ("bench", "draft", "tiny", "trained")
