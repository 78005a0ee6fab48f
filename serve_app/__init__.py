"""pagedserve on Ray Serve: an OpenAI/Anthropic-compatible ingress in front of engine replicas."""
