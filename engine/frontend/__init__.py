"""What callers hold: LLM, AsyncLLM, and turning prompts into requests and tokens into text."""
