"""Sessions on a route: the hop side of seams and the entry side that drives a generation."""
