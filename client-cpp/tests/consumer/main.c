/* Uses the installed commd static library from C: a one-rank broadcast. */
#include <commd.h>

#include <stdio.h>
#include <string.h>

#define CHECK(call)                                                                      \
  do {                                                                                   \
    commd_status_t s_ = (call);                                                          \
    if (s_ != COMMD_OK) {                                                                \
      fprintf(stderr, "%s: %s: %s\n", #call, commd_status_name(s_), commd_last_error()); \
      return 1;                                                                          \
    }                                                                                    \
  } while (0)

int main(void) {
  if (strcmp(commd_version(), COMMD_VERSION) != 0) {
    fprintf(stderr, "library %s, header %s\n", commd_version(), COMMD_VERSION);
    return 1;
  }
  commd_session_t* s = NULL;
  commd_unique_id_t id;
  commd_comm_t* comm = NULL;
  commd_buffer_t* b = NULL;
  CHECK(commd_session_open(NULL, &s));
  CHECK(commd_get_unique_id(s, &id));
  CHECK(commd_comm_init(s, &id, 0, 1, 0, 0, &comm));
  CHECK(commd_buffer_alloc(s, 64 * sizeof(double), &b));
  double* d = commd_buffer_data(b);
  for (int i = 0; i < 64; i++) d[i] = i * 1.5;
  CHECK(commd_broadcast(comm, b, 0, b, 0, 64, COMMD_FLOAT64, 0, NULL));
  for (int i = 0; i < 64; i++) {
    if (d[i] != i * 1.5) {
      fprintf(stderr, "element %d is %g\n", i, d[i]);
      return 1;
    }
  }
  commd_buffer_free(b);
  commd_comm_destroy(comm);
  commd_session_close(s);
  printf("consumer_c_static: ok (commd %s)\n", commd_version());
  return 0;
}
