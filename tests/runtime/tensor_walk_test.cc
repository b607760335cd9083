// The walkers protoc-gen-rdmarpc generates (rdmarpc/generated_support.h)
// against the reflection walk they replace (runtime/tensor_walk.h).
#include "runtime/tensor_walk.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/dynamic_message.h"
#include "rdmarpc/generated_support.h"
#include "runtime_test.pb.h"

namespace rdmarpc::internal {
namespace {

using rdmarpc_runtime_test::Deep;
using rdmarpc_runtime_test::Inner;
using rdmarpc_runtime_test::Node;
using rdmarpc_runtime_test::Outer;
using rdmarpc_runtime_test::Shapes;

// A tensor told apart from the others by its shape.
void Mark(Tensor* t, int64_t id) { t->add_shape(id); }

Outer SampleOuter(int64_t base) {
  Outer o;
  Mark(o.mutable_first(), base + 1);
  Mark(o.add_extras(), base + 2);
  Mark(o.add_extras(), base + 3);
  Inner* layer = o.add_layers();
  Mark(layer->mutable_weights(), base + 4);
  Mark(layer->mutable_bias(), base + 5);
  o.add_layers();  // an element without tensors
  Mark(o.add_layers()->mutable_weights(), base + 6);
  (*o.mutable_labels())["k"] = "v";  // a map without tensors
  return o;
}

// Messages with every kind of field the walk goes through.
std::vector<Shapes> Samples() {
  std::vector<Shapes> samples(5);
  // [0]: empty. [1]: everything set, the oneof holding a tensor.
  Shapes& all = samples[1];
  Mark(all.mutable_tensor(), 1);
  all.set_note("n");
  Mark(all.mutable_deep()->mutable_next()->mutable_tensor(), 2);
  Mark(all.mutable_deep()->mutable_tensor(), 3);
  *all.add_outers() = SampleOuter(10);
  all.add_outers();
  *all.add_outers() = SampleOuter(20);
  Mark(all.mutable_chosen_tensor(), 4);
  Mark(all.mutable_inner()->mutable_bias(), 5);
  // [2]: the oneof holding a message with tensors.
  Mark(samples[2].mutable_chosen_inner()->mutable_weights(), 6);
  Mark(samples[2].mutable_chosen_inner()->mutable_bias(), 7);
  // [3]: nested repeated only. [4]: set messages without tensors in them.
  *samples[3].add_outers() = SampleOuter(30);
  samples[4].mutable_inner();
  samples[4].mutable_chosen_inner();
  samples[4].add_outers()->add_layers();
  return samples;
}

// Walks `msg` as the runtime does and by reflection alone; both must give
// the same status, the same tensor objects in the same order, and the same
// top-level fields.
void ExpectWalksAgree(google::protobuf::Message* msg) {
  SCOPED_TRACE(msg->ShortDebugString());
  MutableTensorList walked;
  TopFieldList walked_top;
  const Status status = CollectMutableTensors(msg, &walked, &walked_top);
  TensorList reflected;
  TopFieldList reflected_top;
  const Status reflection_status =
      CollectTensorsByReflection(*msg, &reflected, &reflected_top);
  EXPECT_EQ(status, reflection_status);
  if (!status.ok()) return;
  ASSERT_EQ(walked.size(), reflected.size());
  for (size_t i = 0; i < walked.size(); ++i) {
    EXPECT_EQ(walked[i], reflected[i]) << "tensor " << i;
  }
  EXPECT_EQ(walked_top, reflected_top);
}

TEST(GeneratedTensorWalkTest, TypesHoldingTensorsHaveAGeneratedWalker) {
  EXPECT_TRUE(WalksWithGeneratedWalker(Outer()));
  EXPECT_TRUE(WalksWithGeneratedWalker(Inner()));
  EXPECT_TRUE(WalksWithGeneratedWalker(Shapes()));
  EXPECT_TRUE(WalksWithGeneratedWalker(Deep()));
  // Nothing to walk in these: no walker generated.
  EXPECT_FALSE(WalksWithGeneratedWalker(Node()));
  EXPECT_FALSE(WalksWithGeneratedWalker(Tensor()));
  // Compiled without our plugin.
  EXPECT_FALSE(WalksWithGeneratedWalker(google::protobuf::FileDescriptorSet()));
}

// One DynamicMessage class serves every dynamic type (codec_test.cc walks
// them).
TEST(GeneratedTensorWalkTest, DynamicMessagesHaveNone) {
  google::protobuf::DynamicMessageFactory factory;
  std::unique_ptr<google::protobuf::Message> dynamic(
      factory.GetPrototype(Shapes::descriptor())->New());
  EXPECT_FALSE(WalksWithGeneratedWalker(*dynamic));
}

// A walker registered for a class is what walks its messages: this one
// reports a tensor that GeneratedCodeInfo cannot hold.
Tensor* const kPlanted = new Tensor;

Status PlantTensor(const google::protobuf::Message& message,
                   const generated::TensorWalk& walk) {
  return generated::VisitTensor(walk, 7, *kPlanted);
}

TEST(GeneratedTensorWalkTest, TheRegisteredWalkerWalks) {
  const google::protobuf::GeneratedCodeInfo info;
  EXPECT_TRUE(generated::RegisterTensorWalker(typeid(info), &PlantTensor));
  TensorList found;
  ASSERT_TRUE(CollectTensors(info, &found).ok());
  EXPECT_EQ(found, (TensorList{kPlanted}));
  TopFieldList top;
  ASSERT_TRUE(CollectTensorTopFields(info, &top).ok());
  EXPECT_EQ(top, (TopFieldList{7}));
}

TEST(GeneratedTensorWalkTest, GeneratedAndReflectionWalksAgree) {
  for (Shapes& sample : Samples()) ExpectWalksAgree(&sample);
  Outer outer = SampleOuter(0);
  ExpectWalksAgree(&outer);
  Shapes all = Samples()[1];
  TensorList found;
  ASSERT_TRUE(CollectTensors(all, &found).ok());
  std::vector<int64_t> order;
  for (const Tensor* t : found) order.push_back(t->shape(0));
  // tensor (1); deep (3): next's tensor, then its own; outers (4), each
  // layer's bias (1) before its weights (2); chosen_tensor (6); inner (7).
  EXPECT_EQ(order, (std::vector<int64_t>{1, 2, 3, 11, 12, 13, 15, 14, 16, 21,
                                         22, 23, 25, 24, 26, 4, 5}));
}

TEST(GeneratedTensorWalkTest, MapsHoldingTensorsAreRefusedAlike) {
  Outer outer = SampleOuter(0);
  (*outer.mutable_named())["x"].mutable_bias();
  ExpectWalksAgree(&outer);
  TensorList found;
  Status s = CollectTensors(outer, &found);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "field rdmarpc_runtime_test.Outer.named is a map holding "
            "rdmarpc.Tensor values; tensors in maps are not supported (use a "
            "repeated message with a key field)");
  // Below the top too.
  Shapes shapes = Samples()[1];
  (*shapes.mutable_outers(1)->mutable_named())["y"];
  ExpectWalksAgree(&shapes);
  EXPECT_EQ(CollectTensors(shapes, &found).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(GeneratedTensorWalkTest, DepthLimitAlike) {
  // The top message is at depth 0; protobuf's parser stops at 100 too.
  for (int levels : {100, 101}) {
    Deep top;
    Deep* deep = &top;
    for (int i = 0; i < levels; ++i) deep = deep->mutable_next();
    Mark(deep->mutable_tensor(), levels);
    ExpectWalksAgree(&top);
    TensorList found;
    Status s = CollectTensors(top, &found);
    if (levels == 100) {
      EXPECT_TRUE(s.ok()) << s;
      EXPECT_EQ(found.size(), 1u);
    } else {
      EXPECT_EQ(s.message(), "message nesting deeper than 100");
    }
  }
}

TEST(GeneratedTensorWalkTest, ACallsMessageCannotBeATensor) {
  Tensor tensor;
  ExpectWalksAgree(&tensor);
  TensorList found;
  EXPECT_EQ(CollectTensors(tensor, &found).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rdmarpc::internal
