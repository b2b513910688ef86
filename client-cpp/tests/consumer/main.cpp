// Uses the installed commd (shared library, C++ wrapper): a one-rank all-reduce through the
// daemon at $COMMD_SOCKET, and the library version against the package's.
#include <commd.hpp>

#include <cstring>
#include <iostream>

int main() {
  if (std::strcmp(commd::version(), EXPECTED_VERSION) != 0) {
    std::cerr << "library " << commd::version() << ", package " << EXPECTED_VERSION << "\n";
    return 1;
  }
  try {
    commd::Session s;
    commd::Communicator comm = s.communicator(s.unique_id(), 0, 1);
    commd::Buffer b = s.alloc_array<int>(100);
    for (int i = 0; i < 100; i++) b.as<int>()[i] = i;
    comm.all_reduce<int>(b, b, 100, commd::RedOp::Sum);
    for (int i = 0; i < 100; i++) {
      if (b.as<int>()[i] != i) {
        std::cerr << "element " << i << " is " << b.as<int>()[i] << "\n";
        return 1;
      }
    }
  } catch (const commd::Error& e) {
    std::cerr << e.status_name() << ": " << e.what() << "\n";
    return 1;
  }
  std::cout << "consumer_cpp: ok (commd " << commd::version() << ")\n";
  return 0;
}
