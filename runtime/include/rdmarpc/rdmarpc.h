// rdmarpc/rdmarpc.h: the whole public API in one include.
//
//   #include <rdmarpc/rdmarpc.h>
//   auto channel = rdmarpc::CreateChannel("localhost:50051");
#ifndef RDMARPC_RDMARPC_H_
#define RDMARPC_RDMARPC_H_

#include "rdmarpc/channel.h"
#include "rdmarpc/client_context.h"
#include "rdmarpc/interceptor.h"
#include "rdmarpc/memory.h"
#include "rdmarpc/server.h"
#include "rdmarpc/status.h"
#include "rdmarpc/tensor.h"

#endif  // RDMARPC_RDMARPC_H_
