"""Training pipelines: data window -> fit -> evaluate -> log -> register -> gate -> promote."""
