"""SGLang's native HTTP protocol: the shapes both our client and our simulator speak."""
