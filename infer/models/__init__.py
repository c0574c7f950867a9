"""Target model implementations (Llama family) and Hugging Face checkpoint loading."""
