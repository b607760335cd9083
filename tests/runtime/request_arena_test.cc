// Its own binary: it replaces the global operator new to count allocations.
#include "runtime/request_arena.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>

#include "rdmarpc/tensor.pb.h"

namespace {
std::atomic<bool> counting{false};
std::atomic<int> allocations{0};
}  // namespace

void* operator new(size_t size) {
  if (counting.load(std::memory_order_relaxed)) allocations.fetch_add(1);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
// GCC takes these frees, inlined where a `new` was, for mismatched ones:
// this operator new is malloc.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

namespace rdmarpc::internal {
namespace {

// Allocations made by `f`, counted on every thread while it runs.
template <typename F>
int AllocationsOf(F&& f) {
  allocations = 0;
  counting = true;
  f();
  counting = false;
  return allocations.load();
}

std::string SmallTensorBytes() {
  Tensor t;
  t.set_dtype(DTYPE_F32);
  t.add_shape(4);
  t.add_shape(4);
  t.set_data("8 bytes!");  // within std::string's inline 15: no buffer
  return t.SerializeAsString();
}

TEST(RequestArenaTest, ASmallRequestAndItsResponseTakeOneAllocation) {
  const std::string wire = SmallTensorBytes();
  // On the heap the same request takes several (the message, its shape,
  // its bytes' string, ...): what the arena saves.
  const int on_heap = AllocationsOf([&] {
    auto heap = std::make_unique<Tensor>();
    ASSERT_TRUE(heap->ParseFromString(wire));
  });
  EXPECT_GE(on_heap, 3);
  std::shared_ptr<google::protobuf::Message> request;
  std::shared_ptr<google::protobuf::Message> response;
  EXPECT_EQ(AllocationsOf([&] {
              request = RequestArena::New(Tensor::default_instance());
              ASSERT_TRUE(request->ParseFromString(wire));
              // As the dispatcher makes a handler's response.
              response = {request,
                          Tensor::default_instance().New(request->GetArena())};
              auto* r = static_cast<Tensor*>(response.get());
              r->add_shape(2);
              r->set_data("7 bytes");
            }),
            1);
  ASSERT_NE(request->GetArena(), nullptr);
  EXPECT_EQ(static_cast<Tensor&>(*request).shape_size(), 2);
  EXPECT_EQ(static_cast<Tensor&>(*request).data(), "8 bytes!");
  // The response keeps the arena when the request's owner goes first.
  request.reset();
  EXPECT_EQ(static_cast<Tensor&>(*response).data(), "7 bytes");
}

TEST(RequestArenaTest, ABigRequestGrowsItsArenaFromTheHeap) {
  Tensor big;
  big.set_data(std::string(64 << 10, 'z'));
  const std::string wire = big.SerializeAsString();
  std::shared_ptr<google::protobuf::Message> request =
      RequestArena::New(Tensor::default_instance());
  ASSERT_TRUE(request->ParseFromString(wire));
  EXPECT_EQ(static_cast<Tensor&>(*request).data().size(), size_t{64} << 10);
}

}  // namespace
}  // namespace rdmarpc::internal
