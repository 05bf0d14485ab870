"""Generated gRPC and protobuf code, one subpackage per API version; never edited by hand."""
