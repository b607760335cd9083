// Walk order and the checks on received tensors (runtime/codec.h).
#include "runtime/codec.h"

#include <gtest/gtest.h>

#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/dynamic_message.h"
#include "google/protobuf/text_format.h"
#include "runtime/access.h"
#include "runtime/tensor_walk.h"
#include "runtime_test.pb.h"

namespace rdmarpc::internal {
namespace {

using rdmarpc_runtime_test::Outer;

Outer Sample() {
  Outer o;
  o.mutable_first()->set_dtype(DTYPE_U8);
  o.add_extras()->set_dtype(DTYPE_I8);
  o.add_extras()->set_dtype(DTYPE_I16);
  auto* l = o.add_layers();
  l->mutable_bias()->set_dtype(DTYPE_F32);
  l->mutable_weights()->set_dtype(DTYPE_F64);
  o.add_layers()->mutable_weights()->set_dtype(DTYPE_BF16);
  return o;
}

TEST(TensorWalkTest, DepthFirstInFieldNumberOrder) {
  Outer o = Sample();
  TensorList found;
  ASSERT_TRUE(CollectTensors(o, &found).ok());
  std::vector<DType> order;
  for (const Tensor* t : found) order.push_back(t->dtype());
  EXPECT_EQ(order, (std::vector<DType>{DTYPE_U8, DTYPE_I8, DTYPE_I16, DTYPE_F32,
                                       DTYPE_F64, DTYPE_BF16}));
  // The receiver's walk over the parsed bytes sees the same order.
  Outer parsed;
  ASSERT_TRUE(parsed.ParseFromString(o.SerializeAsString()));
  MutableTensorList again;
  ASSERT_TRUE(CollectMutableTensors(&parsed, &again).ok());
  ASSERT_EQ(again.size(), found.size());
  for (size_t i = 0; i < again.size(); ++i) {
    EXPECT_EQ(again[i]->dtype(), found[i]->dtype());
  }
}

TEST(TensorPlacementTest, FieldsPlacedApartOverrideTheDefault) {
  Outer o = Sample();  // first (1), extras (2) x2, layers (3): 3 tensors
  TensorPlacement where(Device::Cuda(0));
  where.by_field[2] = Device::Host();  // extras
  auto devices = where.Resolve(o);
  ASSERT_TRUE(devices.ok()) << devices.status();
  EXPECT_EQ(*devices, (std::vector<Device>{Device::Cuda(0), Device::Host(),
                                           Device::Host(), Device::Cuda(0),
                                           Device::Cuda(0), Device::Cuda(0)}));
  TopFieldList top;
  ASSERT_TRUE(CollectTensorTopFields(o, &top).ok());
  EXPECT_EQ(top, (TopFieldList{1, 2, 2, 3, 3, 3}));
  EXPECT_EQ(where.Devices().size(), 2u);
}

TEST(TensorWalkTest, MapsHoldingTensorsAreRefused) {
  Outer o;
  (*o.mutable_labels())["k"] = "v";  // a map without tensors is fine
  TensorList found;
  EXPECT_TRUE(CollectTensors(o, &found).ok());
  (*o.mutable_named())["x"].mutable_bias()->set_dtype(DTYPE_U8);
  Status s = CollectTensors(o, &found);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("map"), absl::string_view::npos) << s;
}

TEST(TensorWalkTest, RecursiveMapWithoutTensorsIsFine) {
  rdmarpc_runtime_test::Node n;
  (*(*n.mutable_children())["a"].mutable_children())["b"].set_name("leaf");
  TensorList found;
  Status s = CollectTensors(n, &found);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_TRUE(found.empty());
}

// DynamicMessage is one C++ class for every type it builds: the walk must
// not take one type's layout for another's.
TEST(TensorWalkTest, DynamicMessagesOfDifferentTypesWalkTheirOwnFields) {
  google::protobuf::FileDescriptorProto file;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      R"pb(
        name: "dynamic_walk.proto"
        package: "dynamic_walk"
        dependency: "rdmarpc/tensor.proto"
        syntax: "proto3"
        message_type {
          name: "One"
          field {
            name: "t"
            number: 1
            label: LABEL_OPTIONAL
            type: TYPE_MESSAGE
            type_name: ".rdmarpc.Tensor"
          }
        }
        message_type {
          name: "Two"
          field { name: "n" number: 1 label: LABEL_OPTIONAL type: TYPE_INT32 }
          field {
            name: "u"
            number: 2
            label: LABEL_OPTIONAL
            type: TYPE_MESSAGE
            type_name: ".rdmarpc.Tensor"
          }
          field {
            name: "v"
            number: 3
            label: LABEL_REPEATED
            type: TYPE_MESSAGE
            type_name: ".rdmarpc.Tensor"
          }
        }
      )pb",
      &file));
  google::protobuf::DescriptorPool pool(
      google::protobuf::DescriptorPool::generated_pool());
  ASSERT_NE(pool.BuildFile(file), nullptr);
  google::protobuf::DynamicMessageFactory factory;
  // Tensor fields hold generated rdmarpc::Tensor objects, as the walk needs.
  factory.SetDelegateToGeneratedFactory(true);
  std::unique_ptr<google::protobuf::Message> one(
      factory.GetPrototype(pool.FindMessageTypeByName("dynamic_walk.One"))
          ->New());
  std::unique_ptr<google::protobuf::Message> two(
      factory.GetPrototype(pool.FindMessageTypeByName("dynamic_walk.Two"))
          ->New());
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      "t { dtype: DTYPE_U8 }", one.get()));
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      "n: 7 u { dtype: DTYPE_I8 } v { dtype: DTYPE_I16 } v { dtype: DTYPE_F32 "
      "}",
      two.get()));
  for (int round = 0; round < 2; ++round) {
    TensorList found;
    ASSERT_TRUE(CollectTensors(*one, &found).ok());
    ASSERT_EQ(found.size(), 1u);
    EXPECT_EQ(found[0]->dtype(), DTYPE_U8);
    TopFieldList top;
    ASSERT_TRUE(CollectTensorTopFields(*two, &top).ok());
    EXPECT_EQ(top, (TopFieldList{2, 3, 3}));
  }
}

Outer OneTensor(DType dtype, std::vector<int64_t> shape) {
  Outer o;
  o.mutable_first()->set_dtype(dtype);
  for (int64_t d : shape) o.mutable_first()->add_shape(d);
  return o;
}

TEST(AcceptIncomingTest, AllocatesAndBindsOutOfBandTensors) {
  Outer o = OneTensor(DTYPE_F32, {4, 4});
  CallTensors tensors;
  IncomingPart part{true, 64, {}};
  auto r = AcceptIncoming(&o, {&part, 1}, Device::Host(), 1 << 20, nullptr,
                          &tensors);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->landing.size(), 1u);
  EXPECT_EQ(r->landing[0].size(), 64u);
  EXPECT_EQ(tensors.Get(o.first())->data(), r->landing[0].data());
  EXPECT_EQ(o.first().byte_size(), 64u);
}

TEST(AcceptIncomingTest, RejectsWhatAPeerMustNotSend) {
  struct Case {
    const char* name;
    Outer msg;
    std::vector<IncomingPart> parts;
    uint64_t budget;
    absl::StatusCode code;
  };
  Outer with_inline = OneTensor(DTYPE_U8, {3});
  with_inline.mutable_first()->set_data("abc");
  Outer bad_byte_size = OneTensor(DTYPE_U8, {3});
  bad_byte_size.mutable_first()->set_byte_size(4);
  std::vector<Case> cases = {
      {"count",
       OneTensor(DTYPE_U8, {3}),
       {{true, 3, {}}, {true, 3, {}}},
       1 << 20,
       absl::StatusCode::kInvalidArgument},
      {"size",
       OneTensor(DTYPE_U8, {3}),
       {{true, 4, {}}},
       1 << 20,
       absl::StatusCode::kInvalidArgument},
      {"dtype",
       OneTensor(static_cast<DType>(99), {3}),
       {{true, 3, {}}},
       1 << 20,
       absl::StatusCode::kInvalidArgument},
      {"negative",
       OneTensor(DTYPE_U8, {-3}),
       {{true, 0, {}}},
       1 << 20,
       absl::StatusCode::kInvalidArgument},
      {"both",
       with_inline,
       {{true, 3, {}}},
       1 << 20,
       absl::StatusCode::kInvalidArgument},
      {"inline short",
       OneTensor(DTYPE_U8, {3}),
       {{false, 3, {}}},
       1 << 20,
       absl::StatusCode::kInvalidArgument},
      {"byte_size",
       bad_byte_size,
       {{true, 3, {}}},
       1 << 20,
       absl::StatusCode::kInvalidArgument},
      {"budget",
       OneTensor(DTYPE_U8, {4096}),
       {{true, 4096, {}}},
       4095,
       absl::StatusCode::kResourceExhausted},
  };
  for (Case& c : cases) {
    SCOPED_TRACE(c.name);
    CallTensors tensors;
    auto r = AcceptIncoming(&c.msg, c.parts, Device::Host(), c.budget, nullptr,
                            &tensors);
    EXPECT_EQ(r.status().code(), c.code) << r.status();
    EXPECT_EQ(CallTensorsAccess::Find(tensors, c.msg.first()), nullptr);
  }
}

TEST(PlanOutgoingTest, BoundTensorsGoOutOfBandOthersInline) {
  Outer o;
  o.mutable_first()->set_dtype(DTYPE_U8);
  o.mutable_first()->add_shape(2);
  o.mutable_first()->set_data("hi");
  CallTensors tensors;
  char bytes[8] = {};
  ASSERT_TRUE(tensors
                  .Set(o.add_extras(), DTYPE_I32, {2},
                       TensorBuffer::Borrow(bytes, sizeof(bytes)))
                  .ok());
  auto plan = PlanOutgoing(o, tensors);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->tensors.size(), 2u);
  EXPECT_FALSE(plan->tensors[0].out_of_band);
  EXPECT_TRUE(plan->tensors[1].out_of_band);
  EXPECT_EQ(plan->total_bytes, 10u);
}

// Errors name the field by its path in the message, and a field set but
// holding no tensor is called missing.
TEST(PlanOutgoingTest, ErrorsNameTheFieldAndSayMissing) {
  Outer o;
  o.add_layers();
  o.add_layers()->mutable_bias();  // set, but no tensor in it
  auto plan = PlanOutgoing(o, CallTensors());
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(plan.status().message().find("'layers[1].bias'"),
            absl::string_view::npos)
      << plan.status();
  EXPECT_NE(plan.status().message().find("missing"), absl::string_view::npos)
      << plan.status();

  Outer unbound;
  unbound.mutable_first()->set_dtype(DTYPE_F32);
  unbound.mutable_first()->add_shape(4);
  plan = PlanOutgoing(unbound, CallTensors());
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find("tensor field 'first'"),
            absl::string_view::npos)
      << plan.status();
  EXPECT_NE(plan.status().message().find("no buffer bound"),
            absl::string_view::npos)
      << plan.status();
}

TEST(TensorFieldPathTest, FindsNestedAndRepeatedFields) {
  Outer o = Sample();
  EXPECT_EQ(TensorFieldPath(o, o.first()), "first");
  EXPECT_EQ(TensorFieldPath(o, o.extras(1)), "extras[1]");
  EXPECT_EQ(TensorFieldPath(o, o.layers(1).weights()), "layers[1].weights");
  Tensor elsewhere;
  EXPECT_EQ(TensorFieldPath(o, elsewhere), "");
}

}  // namespace
}  // namespace rdmarpc::internal
