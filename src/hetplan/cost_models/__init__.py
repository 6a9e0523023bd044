"""How long things take: compute, communication, compression, memory, and the timeline
simulator that every pass uses as its single objective (see DESIGN.md)."""
