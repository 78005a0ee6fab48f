"""The engine core: requests, the scheduler, the KV cache's blocks and the step loop; token ids in and out."""
