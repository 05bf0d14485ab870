"""gRPC servicers: convert from proto, call the runtime, convert back. No queue logic here."""
