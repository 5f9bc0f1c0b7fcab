"""Images in prompts: mlx-vlm's vision-language models on the engine's batched paged step."""
