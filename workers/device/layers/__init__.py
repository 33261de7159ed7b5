"""Model building blocks: parallel linear/embedding, norms, rotary, paged attention, sampler."""
