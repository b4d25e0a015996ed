"""Token engines: the HTTP client, the guarded leg every engine call goes through, request builders, the native OpenAI passthrough."""
