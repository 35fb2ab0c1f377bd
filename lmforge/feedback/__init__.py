"""AI feedback: constitutions, the critics and judges that apply them (an lmforge checkpoint in
process, any OpenAI-compatible endpoint, a Python callable), critique-revision rounds and
position-balanced preference labels (Bai et al. 2022, Constitutional AI)."""
