"""Speculative decoding: drafters propose a row's next tokens, one forward verifies them
(scheduler.VerifyRow), and a budget decides per step and row how many are worth it."""
