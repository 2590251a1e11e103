"""The plan's accuracy band (#52): how far a planned peak may be from the traced step's, below and above."""

TOLERANCE = 0.03
SAFE_BAND = (-0.01, TOLERANCE)
"""Under is the unsafe side (a run the plan says fits may not). plan/accuracy.py holds every case to it; plan/media.py
traces a tower on more images until its peak is bracketed within it."""
