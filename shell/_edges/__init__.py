"""The shell's edges (private): checkpoint files and the run log, progress, epoch logs,
stop events, warnings at the user's line, the compilation cache.
"""
