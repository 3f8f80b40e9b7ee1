"""Sessions on a route: the hop side of seams and the entry side that drives a generation."""

# speculative decoding's modes, importable without torch (meshctl's argument parser and the settings
# need them); meshd.session.drafting implements each
SPECULATIVE_MODES = ("auto", "ngram", "model", "off")
